"""What a workspace holds, and what changed in it between two looks.

A snapshot maps each regular file and symlink under the workspace (``.git`` directories left
out, at any depth: a checkout's own bookkeeping is not a change of the work, and the control
plane refuses such paths, which could plant hooks where a bundle is written out) to its type, size,
permission bits and SHA-256, or its link target. The first snapshot keeps the bytes of small
text files too, so that the changes can be shown as unified diffs against them.
"""

from __future__ import annotations

import hashlib
import os
import stat
from typing import Literal

from .records import field, record

EntryType = Literal["file", "symlink"]
Operation = Literal["add", "modify", "delete"]
SKIPPED_NAMES = frozenset({".git"})
TEXT_MAX_BYTES = 1024 * 1024  # per file: larger ones change without a diff
TEXT_BUDGET_BYTES = 64 * 1024 * 1024  # the base texts one snapshot keeps, at most
_CHUNK = 1024 * 1024


@record
class Entry:
    """One path of a snapshot."""

    type: EntryType
    size: int
    mode: int  # permission bits, st_mode & 0o777
    sha256: str
    target: str | None = None  # a symlink's target, as written


@record
class Refusal:
    """A path that cannot go into a bundle, and why."""

    path: str
    reason: str


@record(frozen=False)
class Snapshot:
    """The entries of a workspace, the base texts kept, and the paths that were refused."""

    root: str
    entries: dict[str, Entry] = field(default_factory=dict)
    texts: dict[str, bytes] = field(default_factory=dict)
    refused: list[Refusal] = field(default_factory=list)


@record
class Change:
    """One path that differs from the base: ``entry`` is the new state (None: deleted)."""

    path: str
    operation: Operation
    entry: Entry | None


def take_snapshot(root: str, *, keep_texts: bool = False) -> Snapshot:
    """Look at every file under ``root`` (symlinks are not followed)."""
    root = os.path.realpath(root)
    snapshot = Snapshot(root=root)
    budget = TEXT_BUDGET_BYTES if keep_texts else 0
    for directory, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [name for name in dirnames if name.lower() not in SKIPPED_NAMES]
        # A symlink to a directory is listed with the directories; it is a path of its own.
        links = [name for name in dirnames if os.path.islink(os.path.join(directory, name))]
        for name in sorted(n for n in [*filenames, *links] if n.lower() not in SKIPPED_NAMES):
            budget -= _look(snapshot, os.path.join(directory, name), budget)
    return snapshot


def _look(snapshot: Snapshot, path: str, text_budget: int) -> int:
    """Record ``path`` in ``snapshot``; the bytes of base text it kept."""
    relative = os.path.relpath(path, snapshot.root).replace(os.sep, "/")
    try:
        relative.encode("utf-8")
    except UnicodeEncodeError:
        snapshot.refused.append(Refusal(repr(relative)[1:-1], "the name is not UTF-8"))
        return 0
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        target = os.readlink(path)
        if not _inside(snapshot.root, os.path.realpath(path)):
            reason = "a symlink pointing outside the workspace"
            snapshot.refused.append(Refusal(relative, reason))
            return 0
        digest = hashlib.sha256(target.encode("utf-8", "surrogateescape")).hexdigest()
        snapshot.entries[relative] = Entry("symlink", 0, 0o777, digest, target)
        return 0
    if not stat.S_ISREG(info.st_mode):
        snapshot.refused.append(Refusal(relative, "not a regular file or a symlink"))
        return 0
    digest, text = _digest(path, keep=info.st_size <= min(TEXT_MAX_BYTES, text_budget))
    snapshot.entries[relative] = Entry("file", info.st_size, info.st_mode & 0o777, digest)
    if text is not None:
        snapshot.texts[relative] = text
        return len(text)
    return 0


def _inside(root: str, resolved: str) -> bool:
    return resolved == root or resolved.startswith(root + os.sep)


def _digest(path: str, *, keep: bool) -> tuple[str, bytes | None]:
    """The file's SHA-256, and its bytes when ``keep`` and they are text."""
    digest = hashlib.sha256()
    kept = bytearray() if keep else None
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            if kept is not None:
                kept += chunk
    text = bytes(kept) if kept is not None and is_text(bytes(kept)) else None
    return digest.hexdigest(), text


def is_text(data: bytes) -> bool:
    """UTF-8 without NUL: what a unified diff can show."""
    if b"\x00" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def changes(base: Snapshot, after: Snapshot) -> list[Change]:
    """What ``after`` added, modified and deleted relative to ``base``, by path."""
    found = []
    for path, entry in after.entries.items():
        old = base.entries.get(path)
        if old is None:
            found.append(Change(path, "add", entry))
        elif old != entry:
            found.append(Change(path, "modify", entry))
    found += [Change(path, "delete", None) for path in base.entries if path not in after.entries]
    return sorted(found, key=lambda change: change.path)
