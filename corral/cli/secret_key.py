"""`corral secret-key`: make a key, and rotate what the database holds sealed to it."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Annotated

import typer

from corral.cli.output import fail, runtime

if TYPE_CHECKING:
    from collections.abc import Callable

    from corral.shared.store.rekey import Report

secret_key_app = typer.Typer(
    help="Print a new random value for CORRAL_SECRET_KEY; `rotate` and `check` for rotation.",
    invoke_without_command=True,
)


@secret_key_app.callback()
def new_key(ctx: typer.Context) -> None:
    """Print a new random value for CORRAL_SECRET_KEY."""
    if ctx.invoked_subcommand is None:
        typer.echo(secrets.token_urlsafe(32))


Batch = Annotated[int, typer.Option(min=1, max=10_000, help="Rows per transaction.")]


@secret_key_app.command("rotate")
def rotate(batch: Batch = 200) -> None:
    """Seal every sealed value in the database again under CORRAL_SECRET_KEY (values sealed
    with a key of CORRAL_SECRET_KEY_PREVIOUS are opened with it). Safe to run again and
    while the stack runs; exit 0 when no value depends on a previous key any more."""
    from corral.shared.store import rekey

    report = _walked(rekey.rotate, batch)
    for table, count in report.resealed.items():
        typer.echo(f"{table}: {count} resealed")
    _conclude(report)


@secret_key_app.command("check")
def check(batch: Batch = 200) -> None:
    """Count the values that still depend on a previous key or an old format (exit 1 if
    any: the previous keys are still needed)."""
    from corral.shared.store import rekey

    report = _walked(rekey.check, batch)
    for table, rows in report.stale.items():
        typer.echo(f"{table}: {len(rows)} to reseal")
    _conclude(report)


def _walked(walk: Callable[..., Report], batch: int) -> Report:
    """``walk`` (:func:`rekey.rotate` or :func:`rekey.check`) over the database, which is
    disposed of after."""
    from corral.shared.keyring import keyring_of

    rt = runtime()
    keyring = keyring_of(rt.settings)
    if keyring is None:
        raise fail("CORRAL_SECRET_KEY is not set: nothing can be sealed or rotated")
    try:
        return walk(rt.db, keyring, batch=batch)
    finally:
        rt.db.dispose()


def _conclude(report: Report) -> None:
    for table, rows in report.unopened.items():
        for row_id, code in rows:
            typer.echo(f"{table} {row_id}: cannot be opened ({code})")
    if report.done:
        typer.echo("no value depends on a previous key: CORRAL_SECRET_KEY_PREVIOUS can go")
        return
    raise fail("some values still depend on a previous key or cannot be opened", code=1)
