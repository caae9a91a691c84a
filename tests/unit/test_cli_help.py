"""Every option and argument of every `corral` command says what it is in `--help`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import typer

from corral.cli.app import app


def parameters(command: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Each parameter of ``command`` and of its subcommands, with the command's path."""
    for param in command.params:
        yield path, param
    for name, sub in getattr(command, "commands", {}).items():
        yield from parameters(sub, f"{path} {name}")


def label(path: str, param: Any) -> str:
    """``corral pools create --org``, ``corral show ITEM_ID``."""
    return f"{path} {param.opts[0] if param.param_type_name == 'option' else param.name.upper()}"


def test_every_option_and_argument_has_help_text() -> None:
    found = list(parameters(typer.main.get_command(app), "corral"))
    assert len({path for path, _ in found}) > 50  # the walk reaches the subcommands
    missing = [label(path, p) for path, p in found if not str(p.help or "").strip()]
    assert not missing, "without help text:\n" + "\n".join(missing)
