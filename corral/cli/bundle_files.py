"""What ``corral bundle`` does: show a work item's result bundle, write its files out,
decide its review. Every path is checked again here: nothing is written outside the
directory, through a symlink, or from a bundle that does not pass :func:`read_bundle`.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import IO, Any

from corral.shared.store.bundle_records import (
    SHA256_PATTERN,
    BundleChangedError,
    BundleStateError,
    bundle_limits,
    open_bundle,
    review_bundle,
)
from corral.shared.store.bundle_store import BundleStore
from corral.shared.store.bundles import BundleContents, BundleError, ManifestEntry, read_bundle
from corral.shared.store.models import BundleReview

ACTOR = "cli"
HELD = (BundleReview.REVIEW_REQUESTED.value, BundleReview.REJECTED.value)


def decide(rt: Any, verb: str, item_id: str, sha256: str | None) -> str:
    """Accept or reject (``verb``) the bundle whose SHA-256 is ``sha256``; its review now.

    Raises:
        typer.Exit: no or a malformed digest, no bundle, or the review refused (printed).
    """
    from corral.cli.output import fail

    if sha256 is None or not re.fullmatch(SHA256_PATTERN, sha256):
        raise fail(
            f"name the bundle you reviewed by its SHA-256: corral bundle {verb} {item_id} "
            f"--sha256 DIGEST (64 hex digits; `corral bundle {item_id}` prints it, a download "
            "gives it in X-Corral-Bundle-Sha256)"
        )
    decision = BundleReview.ACCEPTED if verb == "accept" else BundleReview.REJECTED
    try:
        return review_bundle(rt.db, item_id, decision, sha256=sha256, actor=ACTOR)
    except BundleChangedError as exc:
        raise fail(f"{exc} (corral bundle {item_id})") from exc
    except (LookupError, BundleStateError) as exc:
        raise fail(str(exc)) from exc


def show_bundle(rt: Any, store: BundleStore, item_id: str, output: Path | None) -> list[str]:
    """The summary lines (and the diffs without ``output``); with it, the files written.

    Raises:
        LookupError: no bundle.
        BundleError: the bundle is refused.
        BundleStateError: held for review (or rejected) and ``output`` given.
        BundleStoreError: the store cannot be read.
    """
    view, stream = open_bundle(rt.db, store, item_id)
    limits = bundle_limits(rt.settings)
    patches: dict[str, bytes] = {}
    with stream:
        contents = read_bundle(stream, limits, lambda entry, name: _Collected(patches, name))
    lines = _summary(item_id, view, contents)
    if output is None:
        return lines + [patches[name].decode("utf-8", "replace") for name in sorted(patches)]
    if view["review"] in HELD:
        raise BundleStateError(
            f"the bundle is {view['review']}: accept it first (review it with `corral bundle "
            f"{item_id}`, then corral bundle accept {item_id} --sha256 DIGEST)"
        )
    root = Path(os.path.realpath(output))
    root.mkdir(parents=True, exist_ok=True)
    again, stream = open_bundle(rt.db, store, item_id)
    if again["sha256"] != view["sha256"]:  # replaced since it was read: its review is not this
        stream.close()
        raise BundleChangedError()
    with stream:
        read_bundle(stream, limits, lambda entry, name: _destination(root, entry, name))
    written = sum(1 for e in contents.manifest.entries if e.file is not None)
    return [*lines, f"wrote {written} files into {root}"]


def _summary(item_id: str, view: dict[str, Any], contents: BundleContents) -> list[str]:
    counts = contents.counts()
    lines = [
        f"{item_id}: {len(contents.manifest.entries)} changes ({counts['add']} added, "
        f"{counts['modify']} modified, {counts['delete']} deleted), "
        f"{contents.content_bytes} bytes; review {view['review']}",
        f"  sha256 {view['sha256']}",
    ]
    for entry in contents.manifest.entries:
        note = f"  ({entry.size} bytes)" if entry.size is not None else ""
        if entry.type == "symlink":
            note = f"  -> {entry.target} (symlink: listed, not written)"
        elif entry.operation == "delete":
            note = "  (listed, not deleted)"
        lines.append(f"  {entry.operation:<7} {entry.path}{note}")
    lines += [f"  refused {r.path}: {r.reason}" for r in contents.manifest.refused]
    return lines


class _Collected(io.BytesIO):
    """A patch's bytes, kept in ``into`` when closed."""

    def __init__(self, into: dict[str, bytes], name: str) -> None:
        super().__init__()
        self._into, self._name = into, name

    def close(self) -> None:
        if not self.closed:
            self._into[self._name] = self.getvalue()
        super().close()


def _destination(root: Path, entry: ManifestEntry, name: str) -> IO[bytes] | None:
    """Where a file member goes in ``root``: never outside it, never through a symlink."""
    if name != entry.file:
        return None  # a patch: shown, not written
    target = root / entry.path
    # Resolved before anything is made: an existing symlink on the way shows here.
    parent = os.path.realpath(target.parent)
    if parent != str(root) and not parent.startswith(str(root) + os.sep):
        raise BundleError(f"refusing to write outside {root}: a directory there is a symlink")
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink():
        target.unlink()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    handle = os.open(target, flags, 0o600)
    os.fchmod(handle, entry.mode if entry.mode is not None else 0o644)
    return os.fdopen(handle, "wb")
