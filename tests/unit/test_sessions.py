"""What a session call accepts, before anything reaches a sandbox: paths with no way out,
commands as argv unless a shell is asked for, env names, and output within its limit."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from corral.scheduler.api.http_errors import InvalidRequest
from corral.scheduler.api.interactive import MAX_PATH, SessionCreate, dispatch_request, sandbox_path
from corral.scheduler.api.interactive_api import ExecBody, _bounded
from corral.shared.messages import field_errors


@pytest.mark.parametrize("path", ["a.txt", "dir/sub/file.bin", "with space/ü.txt", ".hidden"])
def test_paths_inside_the_work_directory_are_accepted(path: str) -> None:
    assert sandbox_path(path, "path") == path


@pytest.mark.parametrize(
    "path",
    [
        "",
        "/etc/passwd",
        "..",
        "../x",
        "a/../../b",
        "a//b",
        "./a",
        "a/.",
        "a\x00b",
        "a\nb",
        "x" * (MAX_PATH + 1),
    ],
)
def test_paths_that_could_leave_it_are_refused_naming_the_field(path: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        sandbox_path(path, "cwd")
    (problem,) = refused.value.problems
    assert problem["field"] == "cwd"
    assert len(path) < 3 or path not in problem["message"]  # never echoed


def test_a_command_is_an_argv_list_unless_a_shell_is_asked_for() -> None:
    assert ExecBody(command=["echo", "hi"]).command == ["echo", "hi"]
    assert ExecBody(command="echo $HOME", shell=True).command == "echo $HOME"
    for body in (
        {"command": "echo hi"},
        {"command": ["echo"], "shell": True},
        {"command": []},
        {"command": ["a\x00b"]},
    ):
        with pytest.raises(ValidationError) as refused:
            ExecBody.model_validate(body)
        fields = [e["field"] for e in field_errors(refused.value, ExecBody)]
        assert fields and all(field.startswith("command") for field in fields)


def test_env_names_are_checked_and_values_never_shown() -> None:
    with pytest.raises(ValidationError) as refused:
        ExecBody.model_validate({"command": ["true"], "env": {"BAD NAME": "s3cret-value"}})
    assert "s3cret-value" not in str(field_errors(refused.value, ExecBody))
    assert "s3cret-value" not in repr(ExecBody(command=["true"], env={"TOKEN": "s3cret-value"}))


def test_output_is_cut_at_the_limit_and_never_inside_a_character() -> None:
    assert _bounded("hello", 5) == ("hello", False)
    assert _bounded("hello!", 5) == ("hello", True)
    assert _bounded("ééé", 5) == ("éé", True)  # 2 bytes each: the third is left whole out


def test_a_sessions_work_item_idles_and_asks_for_commands_and_files() -> None:
    body = SessionCreate(org="acme", project="p", profile="default", env={"A": "1"})
    request = dispatch_request(body, "se-1", ttl_s=600)
    assert request.sandbox_features == ("exec-files",)
    assert request.work.kind == "shell" and request.work.command.startswith("exec sleep ")
    assert request.resources.timeout_s is not None and request.resources.timeout_s > 600
    assert request.idempotency_key == "session:se-1"
    assert request.env == {"A": "1"}
