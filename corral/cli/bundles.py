"""``corral bundle``: read a work item's result bundle, write its files out, review it.

``corral bundle ITEM`` prints what changed, the bundle's SHA-256 and the diffs; ``-o DIR``
writes the added and modified files into DIR (deletions are listed, nothing is deleted) once
the bundle needs no review or was accepted. ``corral bundle accept ITEM --sha256 DIGEST``
decides on the bundle that digest names, and on no other: one uploaded after it was shown
is refused. What it reads and writes: :mod:`corral.cli.bundle_files`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def bundle(
    first: Annotated[str, typer.Argument(metavar="ITEM|accept|reject", help="a work item id")],
    item: Annotated[str | None, typer.Argument(help="after accept or reject: the ITEM")] = None,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Write the changed files into this directory."),
    ] = None,
    sha256: Annotated[
        str | None,
        typer.Option(
            "--sha256",
            help="accept/reject: the SHA-256 of the bundle you reviewed (`corral bundle ITEM` "
            "prints it).",
        ),
    ] = None,
) -> None:
    """Show a work item's result bundle, write its files out (-o DIR), or decide its review
    (`corral bundle accept ITEM --sha256 DIGEST`, `corral bundle reject ...`)."""
    from corral.cli.bundle_files import decide, show_bundle
    from corral.cli.output import fail
    from corral.cli.output import runtime as _runtime
    from corral.shared.errors import CorralError
    from corral.shared.store.bundle_store import make_bundle_store

    rt = _runtime()
    if first in ("accept", "reject"):
        if item is None or output is not None:
            raise fail(f"usage: corral bundle {first} ITEM --sha256 DIGEST")
        typer.echo(f"{item}: bundle {decide(rt, first, item, sha256)}")
        return
    if item is not None or sha256 is not None:
        raise fail("give one ITEM (or accept/reject ITEM --sha256 DIGEST)")
    try:
        store = make_bundle_store(rt.settings)
        lines = show_bundle(rt, store, first, output)
    except (LookupError, CorralError) as exc:
        raise fail(str(exc), code=1) from exc
    typer.echo("\n".join(lines))
