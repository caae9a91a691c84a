"""``corral bundle``: read a work item's result bundle, write its files out, review it.

``corral bundle ITEM`` prints what changed and the diffs; ``-o DIR`` writes the added and
modified files into DIR (deletions are listed, nothing is deleted) once the bundle needs no
review or was accepted. Every path is checked again here: nothing is written outside DIR,
through a symlink, or from a bundle that does not pass :func:`read_bundle`.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import IO, Annotated, Any

import typer

from corral.shared.errors import CorralError
from corral.shared.store.bundle_records import (
    BundleStateError,
    bundle_limits,
    open_bundle,
    review_bundle,
)
from corral.shared.store.bundle_store import BundleStore, make_bundle_store
from corral.shared.store.bundles import BundleContents, BundleError, ManifestEntry, read_bundle
from corral.shared.store.models import BundleReview

ACTOR = "cli"
HELD = (BundleReview.REVIEW_REQUESTED.value, BundleReview.REJECTED.value)


def bundle(
    first: Annotated[str, typer.Argument(metavar="ITEM|accept|reject", help="a work item id")],
    item: Annotated[str | None, typer.Argument(help="after accept or reject: the ITEM")] = None,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Write the changed files into this directory."),
    ] = None,
) -> None:
    """Show a work item's result bundle, write its files out (-o DIR), or decide its review
    (`corral bundle accept ITEM`, `corral bundle reject ITEM`)."""
    from corral.cli.output import fail
    from corral.cli.output import runtime as _runtime

    rt = _runtime()
    if first in ("accept", "reject"):
        if item is None or output is not None:
            raise fail(f"usage: corral bundle {first} ITEM")
        decision = BundleReview.ACCEPTED if first == "accept" else BundleReview.REJECTED
        try:
            review = review_bundle(rt.db, item, decision, actor=ACTOR)
        except (LookupError, BundleStateError) as exc:
            raise fail(str(exc)) from exc
        typer.echo(f"{item}: bundle {review}")
        return
    if item is not None:
        raise fail("give one ITEM (or accept/reject ITEM)")
    try:
        store = make_bundle_store(rt.settings)
        lines = show_bundle(rt, store, first, output)
    except (LookupError, CorralError) as exc:
        raise fail(str(exc), code=1) from exc
    typer.echo("\n".join(lines))


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
            f"the bundle is {view['review']}: accept it first (corral bundle accept {item_id})"
        )
    root = Path(os.path.realpath(output))
    root.mkdir(parents=True, exist_ok=True)
    _, stream = open_bundle(rt.db, store, item_id)
    with stream:
        read_bundle(stream, limits, lambda entry, name: _destination(root, entry, name))
    written = sum(1 for e in contents.manifest.entries if e.file is not None)
    return [*lines, f"wrote {written} files into {root}"]


def _summary(item_id: str, view: dict[str, Any], contents: BundleContents) -> list[str]:
    counts = contents.counts()
    lines = [
        f"{item_id}: {len(contents.manifest.entries)} changes ({counts['add']} added, "
        f"{counts['modify']} modified, {counts['delete']} deleted), "
        f"{contents.content_bytes} bytes; review {view['review']}"
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
