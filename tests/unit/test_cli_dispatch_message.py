"""`corral dispatch`'s message: a message file with the flags put over its fields, checked
with the api's model, env values never in an error; and what `--wait` exits with."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from corral.cli.app import app
from corral.cli.dispatch import (
    Flags,
    MessageError,
    build_message,
    deadline_at,
    keyed,
    read_message,
    validate,
)
from corral.cli.follow import exit_code_of
from corral.cli.output import EXIT_FAILED_WITHOUT_CODE, EXIT_NOT_DISPATCHED

SECRET = "s3cr3t-value-never-shown"
FILE = {
    "org": "acme",
    "project": "web",
    "work": {"kind": "shell", "command": "make test"},
    "env": {"CI": "true"},
    "resources": {"cpu": 2, "timeout_s": 60},
    "egress": {"allow_network": False},
}


def test_flags_are_put_over_the_files_fields_and_the_rest_is_kept() -> None:
    flags = Flags(
        project="api",
        command=["echo", "hi"],
        env=["TOKEN=" + SECRET, "FROM_SHELL"],
        secret_env=["DB_PASSWORD=db-password"],
        git="ssh://git@git.example.com/acme/web.git@v1.2",
        image="python:3.12",
        memory_mb=512,
        deadline="2030-01-01T12:00:00Z",
        review=True,
        allow_hosts=["pypi.org", "10.0.0.0/8"],
        install=["pip install ruff"],
        requires=["git"],
        provider="local",
        idempotency_key="build-1",
    )
    message = build_message(FILE, flags, {"FROM_SHELL": "shell value"})
    assert message == {
        "org": "acme",
        "project": "api",
        "profile": "default",
        "work": {"kind": "shell", "command": "echo hi"},
        "env": {"CI": "true", "TOKEN": SECRET, "FROM_SHELL": "shell value"},
        "secret_env": {"DB_PASSWORD": "db-password"},
        "resources": {"cpu": 2, "timeout_s": 60, "memory_mb": 512},
        "egress": {"allow_network": True, "allowed_hosts": ["pypi.org", "10.0.0.0/8"]},
        "inputs": {"git": {"url": "ssh://git@git.example.com/acme/web.git", "ref": "v1.2"}},
        "image": "python:3.12",
        "expires_at": "2030-01-01T12:00:00Z",
        "bundle": True,
        "review": {"required": True},
        "toolchain": {"install_commands": ["pip install ruff"]},
        "agent_card": {"requires": [{"kind": "git"}]},
        "provider": "local",
        "idempotency_key": "build-1",
    }
    validate(keyed(message))
    assert keyed(message)["idempotency_key"] == "build-1"
    assert FILE["env"] == {"CI": "true"}  # the file's message is not changed


def test_a_message_gets_an_idempotency_key_unless_it_has_one() -> None:
    first = keyed(build_message(FILE, Flags(), {}))
    second = keyed(build_message(FILE, Flags(), {}))
    assert first["idempotency_key"] != second["idempotency_key"]
    assert len(first["idempotency_key"]) == 36
    own = keyed(build_message({**FILE, "idempotency_key": "mine"}, Flags(), {}))
    assert own["idempotency_key"] == "mine"


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (Flags(org="acme"), "--project is required"),
        (Flags(org="acme", project="web"), "give a command after --, or --code-file"),
        (Flags(org="a", project="w", command=["x"], env=["=" + SECRET]), "--env takes NAME=VALUE"),
        (Flags(org="a", project="w", command=["x"], env=["NOT_SET"]), "no NOT_SET in this shell"),
        (Flags(org="a", project="w", command=["x"], git="https://h/r.git"), "--git takes URL@REF"),
        (Flags(org="a", project="w", command=["x"], args=["n=1"]), "--arg goes with --code-file"),
    ],
)
def test_a_flag_that_cannot_be_read_is_an_error(flags: Flags, said: str) -> None:
    with pytest.raises(MessageError) as caught:
        build_message({}, flags, {})
    assert said in str(caught.value)
    assert SECRET not in str(caught.value)


def test_the_model_refuses_a_message_naming_the_field_never_the_value() -> None:
    bad = build_message(FILE, Flags(env=["LD_PRELOAD=" + SECRET], cpu=-1), {})
    with pytest.raises(MessageError) as caught:
        validate(bad)
    said = str(caught.value)
    assert said.startswith("invalid dispatch: ")
    assert "resources.cpu" in said and "env" in said
    assert SECRET not in said


def test_a_deadline_is_a_duration_from_now_or_the_time_given() -> None:
    now = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
    assert deadline_at("90s", now) == "2030-01-01T12:01:30Z"
    assert deadline_at("1h30m", now) == "2030-01-01T13:30:00Z"
    assert deadline_at("2d", now) == "2030-01-03T12:00:00Z"
    assert deadline_at("2030-06-01T00:00:00+02:00", now) == "2030-06-01T00:00:00+02:00"
    assert deadline_at("soon", now) == "soon"  # for the model to refuse, naming expires_at


def test_the_message_file_is_read_from_a_path_or_standard_input(tmp_path: Path) -> None:
    path = tmp_path / "message.json"
    path.write_text(json.dumps(FILE))
    assert read_message(str(path)) == FILE
    assert read_message(None) == {}
    path.write_text("[1, 2]")
    with pytest.raises(MessageError, match="must be a JSON object"):
        read_message(str(path))
    path.write_text('{"org": ')
    with pytest.raises(MessageError, match=r"not JSON \(line 1"):
        read_message(str(path))
    with pytest.raises(MessageError, match="No such file"):
        read_message(str(tmp_path / "missing.json"))


def _final(state: str, code: int | None = None, error: str | None = None) -> dict[str, object]:
    return {
        "state": state,
        "exit_code": code,
        "error": {"code": error, "message": "m"} if error else None,
    }


@pytest.mark.parametrize(
    ("view", "status"),
    [
        (_final("succeeded", 0), 0),
        (_final("failed", 7, "work_failed"), 7),
        (_final("failed", -9, "work_failed"), 137),  # killed by SIGKILL, as a shell says
        (_final("failed", 3, "install_failed"), EXIT_FAILED_WITHOUT_CODE),
        (_final("failed", None, "deadline"), EXIT_FAILED_WITHOUT_CODE),
        (_final("cancelled"), EXIT_FAILED_WITHOUT_CODE),
        (_final("dispatch_error", None, "unknown_profile"), EXIT_NOT_DISPATCHED),
    ],
)
def test_wait_exits_with_the_works_code_or_corrals_own(
    view: dict[str, object], status: int
) -> None:
    assert exit_code_of(view) == status


def test_dispatch_help_names_every_exit_status() -> None:
    shown = " ".join(
        CliRunner().invoke(app, ["dispatch", "--help"], terminal_width=200).output.split()
    )
    for status in ("123 failed without one", "124 --timeout passed", "125 nothing will run"):
        assert status in shown
    assert "the work's own exit code" in shown
