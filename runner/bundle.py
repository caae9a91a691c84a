"""The result bundle: what the work changed in its workspace, as one gzipped tar.

Members, in this order: ``manifest.json`` (version, base, entries, refused), then
``patches/NNNN.diff`` (a unified diff per changed text file), then ``files/<path>`` (the
added and modified regular files). Every member is a plain POSIX ustar file, the only kind the
control plane reads: a changed file whose member name does not fit ustar's fields (100 bytes,
plus a 155-byte prefix split at a ``/``) is left out and named in the manifest's ``refused``.
docs/runner-protocol.md describes the format; the control plane checks every member again
(corral.shared.store.bundles).
"""

from __future__ import annotations

import difflib
import io
import json
import os
import tarfile
import tempfile
from collections.abc import Mapping
from typing import Any, Final

from .protocol import BundleLimits
from .records import record
from .snapshot import (
    TEXT_MAX_BYTES,
    Change,
    Refusal,
    Snapshot,
    changes,
    is_text,
    take_snapshot,
)

FORMAT_VERSION = 1
TAR_FORMAT: Final = tarfile.USTAR_FORMAT  # no pax or GNU headers: the control plane refuses them
TOO_LONG = (
    "the path is too long for the bundle's tar format (ustar: 100 bytes, or 255 split at a '/')"
)
TOO_BIG = "the file is larger than the bundle's tar format holds (ustar: 8 GiB)"
USTAR_MAX_SIZE = 8**11 - 1  # eleven octal digits


class BundleTooLargeError(Exception):
    """The changes are over one of the bundle's limits; the message names it."""


@record
class Bundle:
    """A built bundle: the archive's path (outside the workspace) and what it holds."""

    path: str
    changes: int
    refused: tuple[Refusal, ...]
    content_bytes: int


def build_bundle(base: Snapshot, *, base_info: Mapping[str, Any], limits: BundleLimits) -> Bundle:
    """Compare the workspace with ``base`` and write the bundle to a temporary file.

    Raises:
        BundleTooLargeError: the changes are over a limit (nothing is written).
    """
    after = take_snapshot(base.root)
    found, unfit = _fitting(changes(base, after))
    refused = tuple(r for r in after.refused if r not in base.refused) + unfit
    patches = _patches(base, found, limits)
    manifest = _manifest(found, patches, refused, base_info)
    if len(manifest) > limits.max_manifest_bytes:
        raise BundleTooLargeError(
            f"the bundle's manifest is {len(manifest)} bytes, more than the limit of "
            f"{limits.max_manifest_bytes} bytes; change fewer files"
        )
    total = len(manifest) + sum(len(text) for text in patches.values())
    total += sum(c.entry.size for c in found if c.entry is not None and c.entry.type == "file")
    if total > limits.max_bytes:
        raise BundleTooLargeError(
            f"the work's changes make a bundle of {total} bytes, more than the limit of "
            f"{limits.max_bytes} bytes; change less in the workspace (or leave build output "
            "out of it)"
        )
    path = _write(base.root, manifest, found, patches)
    return Bundle(path=path, changes=len(found), refused=refused, content_bytes=total)


def _fitting(found: list[Change]) -> tuple[list[Change], tuple[Refusal, ...]]:
    """The changes the archive can hold, and a refusal for each added or modified file whose
    member name ustar cannot hold (other changes have no member: their path is in the
    manifest only)."""
    kept, unfit = [], []
    for change in found:
        if change.entry is not None and change.entry.type == "file":
            if change.entry.size > USTAR_MAX_SIZE:
                unfit.append(Refusal(change.path, TOO_BIG))
                continue
            try:
                tarfile.TarInfo(f"files/{change.path}").tobuf(TAR_FORMAT, "utf-8", "strict")
            except ValueError:  # tarfile's "name is too long": it fits no split
                unfit.append(Refusal(change.path, TOO_LONG))
                continue
        kept.append(change)
    return kept, tuple(unfit)


def _patches(base: Snapshot, found: list[Change], limits: BundleLimits) -> dict[str, bytes]:
    """A unified diff for each changed text file whose old text (if any) was kept."""
    patches: dict[str, bytes] = {}
    for change in found:
        diff = _diff(base, change)
        if diff is None:
            continue
        if len(patches) == limits.max_patches:
            raise BundleTooLargeError(
                f"the work changed more than {limits.max_patches} text files, the limit of "
                "patches in one bundle; change fewer files"
            )
        patches[change.path] = diff
    return patches


def _diff(base: Snapshot, change: Change) -> bytes | None:
    old: bytes | None = b""
    if change.operation != "add":
        old = base.texts.get(change.path)
    new = b""
    if change.entry is not None:
        if change.entry.type != "file" or change.entry.size > TEXT_MAX_BYTES:
            return None
        with open(os.path.join(base.root, change.path), "rb") as handle:
            new = handle.read()
    if old is None or not is_text(new):
        return None
    before = "/dev/null" if change.operation == "add" else f"a/{change.path}"
    after = "/dev/null" if change.operation == "delete" else f"b/{change.path}"
    lines = difflib.unified_diff(
        old.decode().splitlines(keepends=True),
        new.decode().splitlines(keepends=True),
        fromfile=before,
        tofile=after,
    )
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines).encode()


def _manifest(
    found: list[Change],
    patches: Mapping[str, bytes],
    refused: tuple[Refusal, ...],
    base_info: Mapping[str, Any],
) -> bytes:
    names = {path: f"patches/{number:04d}.diff" for number, path in enumerate(patches, 1)}
    entries = []
    for change in found:
        entry = change.entry
        is_file = entry is not None and entry.type == "file"
        entries.append(
            {
                "path": change.path,
                "operation": change.operation,
                "type": entry.type if entry else None,
                "size": entry.size if entry else None,
                "sha256": entry.sha256 if entry else None,
                "mode": entry.mode if entry else None,
                "target": entry.target if entry else None,
                "patch": names.get(change.path),
                "file": f"files/{change.path}" if is_file else None,
            }
        )
    body = {
        "version": FORMAT_VERSION,
        "base": dict(base_info),
        "entries": entries,
        "refused": [{"path": r.path, "reason": r.reason} for r in refused],
    }
    return json.dumps(body, indent=1, sort_keys=True).encode()


def _write(root: str, manifest: bytes, found: list[Change], patches: Mapping[str, bytes]) -> str:
    """The archive, in the temporary directory (never in the workspace it describes)."""
    handle, path = tempfile.mkstemp(prefix="corral-bundle-", suffix=".tar.gz")
    with (
        os.fdopen(handle, "wb") as raw,
        tarfile.open(
            fileobj=raw, mode="w:gz", format=TAR_FORMAT, encoding="utf-8", errors="strict"
        ) as archive,
    ):
        _add_bytes(archive, "manifest.json", manifest)
        for number, text in enumerate(patches.values(), 1):
            _add_bytes(archive, f"patches/{number:04d}.diff", text)
        for change in found:
            if change.entry is None or change.entry.type != "file":
                continue
            info = _member_info(f"files/{change.path}", change.entry.size, change.entry.mode)
            with open(os.path.join(root, change.path), "rb") as source:
                archive.addfile(info, source)
    return path


def _add_bytes(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    archive.addfile(_member_info(name, len(data), 0o644), io.BytesIO(data))


def _member_info(name: str, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode = size, mode
    return info
