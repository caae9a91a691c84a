"""``corral dispatch``: one work item, from flags, a message file, or both.

The message is the file's (``--message FILE``, ``-`` for standard input; JSON, the dispatch
message of docs/dispatch.md), with each flag given put over its field, checked with the
api's own model (by the api, or here before it goes to a broker). It goes through the api
when one is known
(:mod:`corral.cli.sending`), with an idempotency key (``--idempotency-key``, else the
message's, else a new one, printed), so that sending it again never makes a second item.

Exit statuses: 0 dispatched (with ``--wait``: it succeeded); with ``--wait``, the work's own
exit code when it ran and failed; :data:`~corral.cli.output.EXIT_FAILED_WITHOUT_CODE` (123)
when it failed without one (an install step, its deadline, a cancel...);
:data:`~corral.cli.output.EXIT_WAIT_TIMEOUT` (124) when ``--timeout`` passed first (the item
goes on); :data:`~corral.cli.output.EXIT_NOT_DISPATCHED` (125) when nothing will run:
refused, not sent, or a dispatch error.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

import typer

from corral.cli.output import (
    EXIT_NOT_DISPATCHED,
    FormatOption,
    OutputFormat,
    fail,
)

_DURATION = re.compile(r"(\d+)\s*(s|m|h|d)")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


class MessageError(ValueError):
    """What is wrong with the message the command line makes; never a value of it."""


@dataclass(frozen=True)
class Flags:
    """The flags of ``corral dispatch`` that set a field of the message (None: not given)."""

    org: str | None = None
    project: str | None = None
    profile: str | None = None
    command: list[str] = field(default_factory=list)
    code_file: Path | None = None
    args: list[str] = field(default_factory=list)
    env: list[str] = field(default_factory=list)
    secret_env: list[str] = field(default_factory=list)
    git: str | None = None
    image: str | None = None
    cpu: float | None = None
    memory_mb: int | None = None
    timeout_s: int | None = None
    deadline: str | None = None
    bundle: bool = False
    review: bool = False
    network: bool = False
    allow_hosts: list[str] = field(default_factory=list)
    install: list[str] = field(default_factory=list)
    requires: list[str] = field(default_factory=list)
    provider: str | None = None
    idempotency_key: str | None = None

    @classmethod
    def given(cls, options: Mapping[str, Any]) -> Flags:
        """The flags among a command's ``options`` (its parameters by name), those not given
        (None) left at their defaults."""
        names = {each.name for each in fields(cls)}
        renamed = {"arg": "args", "allow_host": "allow_hosts"}
        values = {renamed.get(name, name): value for name, value in options.items()}
        return cls(**{n: v for n, v in values.items() if n in names and v is not None})


def build_message(
    base: Mapping[str, Any], flags: Flags, environ: Mapping[str, str]
) -> dict[str, Any]:
    """The message: ``base`` (a message file's) with each flag given put over its field.

    Raises:
        MessageError: a flag that cannot be read (``--env`` without a name...).
    """
    message = copy.deepcopy(dict(base))
    given = {
        "org": flags.org,
        "project": flags.project,
        "profile": flags.profile,
        "image": flags.image,
        "provider": flags.provider,
        "idempotency_key": flags.idempotency_key,
    }
    message.update({name: value for name, value in given.items() if value is not None})
    message.setdefault("profile", "default")
    for name in ("org", "project"):
        if not message.get(name):
            raise MessageError(
                f"--{name} is required (or the message's {name}), e.g. --org acme --project web"
            )
    work = _work(flags)
    if work is not None:
        message["work"] = work
    elif "work" not in message:
        raise MessageError("give a command after --, or --code-file, or a message with work")
    _merge(message, "env", _pairs(flags.env, "--env", environ))
    _merge(message, "secret_env", _pairs(flags.secret_env, "--secret-env", None))
    sizes = {"cpu": flags.cpu, "memory_mb": flags.memory_mb, "timeout_s": flags.timeout_s}
    _merge(message, "resources", {name: v for name, v in sizes.items() if v is not None})
    if flags.install:
        _merge(message, "toolchain", {"install_commands": flags.install})
    if flags.requires:
        _merge(message, "agent_card", {"requires": [{"kind": kind} for kind in flags.requires]})
    if flags.git is not None:
        _merge(message, "inputs", {"git": _git(flags.git)})
    if flags.deadline is not None:
        message["expires_at"] = deadline_at(flags.deadline)
    if flags.bundle or flags.review:
        message["bundle"] = True
    if flags.review:
        message["review"] = {"required": True}
    network = flags.network or bool(flags.allow_hosts)
    hosts = {"allowed_hosts": flags.allow_hosts} if flags.allow_hosts else {}
    _merge(message, "egress", {"allow_network": True, **hosts} if network else {})
    return message


def _merge(message: dict[str, Any], name: str, values: dict[str, Any]) -> None:
    """Put ``values`` over the field ``name`` (an object) of ``message``."""
    if values:
        current = message.get(name)
        message[name] = {**current, **values} if isinstance(current, dict) else values


def _work(flags: Flags) -> dict[str, Any] | None:
    if flags.code_file is not None:
        if flags.command:
            raise MessageError("give a command after -- or --code-file, not both")
        arguments = {}
        for pair in flags.args:
            key, _, raw = pair.partition("=")
            try:
                arguments[key] = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise MessageError(f"--arg {key} is not valid JSON: {exc.msg}") from None
        try:
            code = flags.code_file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise MessageError(f"--code-file {flags.code_file}: cannot be read ({exc})") from None
        return {"kind": "code", "code": code, "arguments": arguments}
    if flags.args:
        raise MessageError("--arg goes with --code-file")
    return {"kind": "shell", "command": " ".join(flags.command)} if flags.command else None


def _pairs(pairs: list[str], option: str, environ: Mapping[str, str] | None) -> dict[str, str]:
    """``NAME=VALUE`` pairs; with ``environ``, a ``NAME`` alone takes this process's value.
    The values are never in an error (``--env``'s are secrets)."""
    found = {}
    for pair in pairs:
        name, equals, value = pair.partition("=")
        if not equals and environ is not None:
            if name not in environ:
                raise MessageError(f"{option} {name}: no {name} in this shell's environment")
            value = environ[name]
        elif not equals or not name:
            raise MessageError(f"{option} takes NAME=VALUE; one has no name or no '='")
        found[name] = value
    return found


def _git(text: str) -> dict[str, str]:
    url, at, ref = text.rpartition("@")
    if not at or not url or not ref:
        raise MessageError("--git takes URL@REF, e.g. https://git.example.com/acme/web.git@main")
    return {"url": url, "ref": ref}


def deadline_at(text: str, now: datetime | None = None) -> str:
    """``--deadline``: a duration from now (90s, 30m, 2h, 1d, or 1h30m) as the instant it
    ends, in ISO 8601 UTC; anything else as it is, for the message's ``expires_at`` to read."""
    parts = _DURATION.findall(text.strip())
    if not parts or "".join(f"{n}{unit}" for n, unit in parts) != re.sub(r"\s", "", text):
        return text
    delta = sum((timedelta(**{_UNITS[unit]: int(n)}) for n, unit in parts), timedelta())
    return ((now or datetime.now(UTC)) + delta).isoformat().replace("+00:00", "Z")


def read_message(source: str | None) -> dict[str, Any]:
    """The message file's object (``-``: standard input); ``{}`` without one.

    Raises:
        MessageError: it cannot be read, is not JSON, or not a JSON object.
    """
    if source is None:
        return {}
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
        found = json.loads(text)
    except OSError as exc:
        raise MessageError(f"--message {source}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}: {exc.msg}"
        raise MessageError(f"--message {source}: not JSON ({where})") from None
    except UnicodeDecodeError:
        raise MessageError(f"--message {source}: not UTF-8 text") from None
    if not isinstance(found, dict):
        raise MessageError(f"--message {source}: the message must be a JSON object")
    return found


def keyed(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with its idempotency key: its own, else a new one."""
    return {**message, "idempotency_key": message.get("idempotency_key") or str(uuid.uuid4())}


def validate(message: dict[str, Any]) -> None:
    """Check ``message`` with the api's own model (the api does so itself: this is for the
    broker, whose intake would record a refused message as a dispatch error).

    Raises:
        MessageError: the model refuses it (each field named, never its value).
    """
    from pydantic import ValidationError

    from corral.shared.messages import DispatchRequest, describe_field_errors, field_errors

    try:
        DispatchRequest.model_validate(message)
    except ValidationError as exc:
        said = describe_field_errors(field_errors(exc))
        raise MessageError(f"invalid dispatch: {said}") from None


Many = Annotated[list[str] | None, typer.Argument(help="The shell command, after --.")]


_Org = Annotated[str | None, typer.Option(help="The org the item belongs to.")]
_Project = Annotated[str | None, typer.Option(help="Its project.")]
_Profile = Annotated[
    str | None, typer.Option(help="The model profile it names (default: default).")
]
_Message = Annotated[
    str | None,
    typer.Option(
        metavar="FILE|-",
        help="The whole message as JSON (docs/dispatch.md), from FILE or standard input "
        "(-); the flags given are put over its fields.",
    ),
]
_CodeFile = Annotated[Path | None, typer.Option(help="Python file defining main(): code work.")]
_Arg = Annotated[
    list[str] | None,
    typer.Option(metavar="NAME=JSON", help="An argument of main(); repeatable."),
]
_Env = Annotated[
    list[str] | None,
    typer.Option(
        metavar="NAME[=VALUE]",
        help="A variable of the work's environment; NAME alone takes this shell's $NAME "
        "(kept off the command line); repeatable. Never printed.",
    ),
]
_SecretEnv = Annotated[
    list[str] | None,
    typer.Option(metavar="NAME=SECRET", help="The named secret SECRET in $NAME; repeatable."),
]
_Git = Annotated[
    str | None,
    typer.Option(metavar="URL@REF", help="A repository checked out into the workspace."),
]
_Image = Annotated[str | None, typer.Option(help="An image of its own (docker, kubernetes pools).")]
_Cpu = Annotated[float | None, typer.Option(help="vCPUs (resources.cpu).")]
_MemoryMb = Annotated[int | None, typer.Option(help="Memory, MiB (resources.memory_mb).")]
_TimeoutS = Annotated[
    int | None, typer.Option(help="Its sandbox's hard deadline, s (resources.timeout_s).")
]
_Deadline = Annotated[
    str | None,
    typer.Option(
        metavar="TIME|DURATION",
        help="expires_at: not final by then, it fails expired. A time with its UTC offset "
        "(2030-01-01T12:00:00Z) or a duration from now (90s, 30m, 2h, 1d).",
    ),
]
_Bundle = Annotated[
    bool, typer.Option("--bundle", help="What the work changed comes back as a bundle.")
]
_Review = Annotated[
    bool, typer.Option("--review", help="Its bundle waits for a review (implies --bundle).")
]
_Network = Annotated[bool, typer.Option("--network", help="Give the sandbox network.")]
_AllowHost = Annotated[
    list[str] | None,
    typer.Option(
        metavar="HOST",
        help="The only destination (host, host:port, IP, CIDR) on the network; "
        "repeatable; implies --network.",
    ),
]
_Install = Annotated[
    list[str] | None,
    typer.Option(metavar="COMMAND", help="An install command; repeatable."),
]
_Requires = Annotated[
    list[str] | None,
    typer.Option(metavar="KIND", help="A requirement kind (git, gpu...); repeatable."),
]
_Provider = Annotated[str | None, typer.Option(help="Only pools of this provider.")]
_IdempotencyKey = Annotated[
    str | None,
    typer.Option(
        help="Send it with this key (a retry: the same key runs it once); "
        "default: the message's, else a new one, printed."
    ),
]
_Wait = Annotated[
    bool,
    typer.Option(
        "--wait",
        help="Follow it to its end: progress on stderr, its output as it comes; "
        "exit with its exit code.",
    ),
]
_Timeout = Annotated[
    float, typer.Option(help="With --wait: give up after this many seconds (exit 124).")
]


def dispatch(
    command: Many = None,
    *,
    org: _Org = None,
    project: _Project = None,
    profile: _Profile = None,
    message: _Message = None,
    code_file: _CodeFile = None,
    arg: _Arg = None,
    env: _Env = None,
    secret_env: _SecretEnv = None,
    git: _Git = None,
    image: _Image = None,
    cpu: _Cpu = None,
    memory_mb: _MemoryMb = None,
    timeout_s: _TimeoutS = None,
    deadline: _Deadline = None,
    bundle: _Bundle = False,
    review: _Review = False,
    network: _Network = False,
    allow_host: _AllowHost = None,
    install: _Install = None,
    requires: _Requires = None,
    provider: _Provider = None,
    idempotency_key: _IdempotencyKey = None,
    wait: _Wait = False,
    timeout: _Timeout = 600,
    output_format: FormatOption = OutputFormat.TEXT,
) -> None:
    """Dispatch one item, e.g. `corral dispatch --org acme --project web -- echo hi`.

    Prints its id (its idempotency key on stderr); through the api when one is known (`corral
    dev`'s, CORRAL_API_URL), else through the broker. With --wait it follows the item and
    streams its output. Exit status: 0 dispatched (--wait: succeeded); with --wait the work's
    own exit code when it failed with one, 123 failed without one (install step, deadline,
    cancel...), 124 --timeout passed first (the item goes on); 125 nothing will run (refused,
    not sent, or a dispatch error)."""
    flags = Flags.given(locals())  # first: the parameters alone
    try:
        sent = keyed(build_message(read_message(message), flags, os.environ))
    except MessageError as exc:
        raise fail(str(exc), code=EXIT_NOT_DISPATCHED) from None
    from corral.cli.sending import send_and_follow

    send_and_follow(sent, wait=wait, timeout_s=timeout, output_format=output_format)
