"""What every command shares for its output: the ``--format`` choice and error exits."""

from __future__ import annotations

import enum
import re
import sys
from typing import Annotated, Any

import typer
from pydantic import SecretStr

from corral.shared.errors import CorralError

# `corral dispatch`'s own exit statuses, beside the work's exit code (which `--wait` passes
# on): at the top of the range, as timeout(1)'s 124 and 125, away from the codes tools use.
EXIT_FAILED_WITHOUT_CODE = 123  # the item failed or was cancelled, no exit code of its work
EXIT_WAIT_TIMEOUT = 124  # --wait gave up before the item ended; the item goes on
EXIT_NOT_DISPATCHED = 125  # nothing will run: refused, not sent, or a dispatch error


class OutputFormat(enum.StrEnum):
    TEXT = "text"
    JSON = "json"


# A choice: anything else (`--format yaml`) is refused by the parser, naming the choices.
FormatOption = Annotated[
    OutputFormat, typer.Option("--format", help="text (a table) or json", case_sensitive=False)
]


# What a terminal acts on rather than shows: C0 but tab and newline, DEL and C1. ESC starts
# every escape sequence (CSI, OSC 52's clipboard write, ...), and C1 holds one-byte forms.
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")

RawOption = Annotated[
    bool,
    typer.Option(
        "--raw",
        help="Write the work's text as it is, control characters and escape sequences "
        "included, also to a terminal.",
    ),
]


def escape_controls(text: str) -> str:
    """``text`` with its control characters shown as ``\\xNN``; tab and newline kept."""
    return _CONTROLS.sub(lambda match: f"\\x{ord(match.group()):02x}", text)


def echo_work_text(text: str, *, err: bool = False, raw: bool = False) -> None:
    """Print text a sandbox produced: escaped when it goes to a terminal (unless ``raw``),
    which would otherwise obey the work's escape sequences; as it is anywhere else."""
    stream = sys.stderr if err else sys.stdout
    if not raw and stream.isatty():
        text = escape_controls(text)
    # color=True: click would strip some ANSI sequences, not all, from a pipe's text.
    typer.echo(text, err=err, color=True)


def progress(message: str) -> None:
    """A progress line on standard error; the work's words in it escaped on a terminal."""
    echo_work_text(message, err=True)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` on standard error; the caller raises what this returns."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def fail_fields(error: Any, model: Any) -> typer.Exit:
    """:func:`fail` for a ``model``'s validation ``error``: each field named, no value."""
    from corral.shared.messages import describe_field_errors, field_errors

    return fail(describe_field_errors(field_errors(error, model)))


def runtime() -> Any:
    """This process's runtime (settings, database, broker configuration), schema checked.

    On the embedded database, without CORRAL_SECRET_KEY, the key `corral dev` keeps beside
    it is used, so that both seal and read with the same one."""
    from corral.cli.processes import prepare
    from corral.shared.settings import CoreSettings

    settings = CoreSettings()
    key_file = settings.state_dir / "secret-key"
    if settings.secret_key is None and settings.database_url is None and key_file.exists():
        settings = settings.model_copy(
            update={"secret_key": SecretStr(key_file.read_text().strip())}
        )
    try:
        return prepare(settings)
    except CorralError as exc:
        raise fail(exc.message) from exc


def cell(value: object) -> str:
    """A table cell: ``-`` for nothing."""
    return "-" if value is None or value == "" else str(value)


def json_option(value: str | None, name: str) -> Any:
    """The JSON an option holds, or a clear error naming the option."""
    import json

    if value is None:
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise fail(f"{name} is not valid JSON: {exc.msg}") from exc
