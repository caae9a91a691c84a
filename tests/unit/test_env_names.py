"""The env rule: POSIX names, no name the dynamic loader or libc acts on, bounded values; and
every field a client's environment arrives in (a dispatch's env and toolchain.env, secret
binding names, a session's env, an exec's env) held to it, refusing without echoing."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from corral.scheduler.api.interactive import SessionCreate
from corral.scheduler.api.interactive_api import ExecBody
from corral.shared.env_names import (
    MAX_ENTRY_BYTES,
    MAX_ENV_BYTES,
    NOT_A_NAME,
    EnvRefusedError,
    check_env,
    check_env_name,
)
from corral.shared.messages import DispatchRequest, describe_field_errors, field_errors
from corral.shared.store.sealing import Sealer
from tests.conftest import TEST_SECRET_KEY

SECRET = "value-never-echoed-5f1c"
LOADER = "is refused: the dynamic loader acts on it"


def dispatch(**fields: Any) -> dict[str, Any]:
    return {
        "org": "acme",
        "project": "web",
        "profile": "default",
        "work": {"kind": "shell", "command": "true"},
        **fields,
    }


def refusal(model: type[BaseModel], raw: dict[str, Any]) -> str:
    """The refusal of ``raw`` as a client reads it: ``field: message; ...``."""
    with pytest.raises(ValidationError) as refused:
        model.model_validate(raw)
    return describe_field_errors(field_errors(refused.value, model))


@pytest.mark.parametrize("name", ["CI", "node_env", "_private", "A1_b2", "TMPDIR", "X" * 255])
def test_posix_names_are_accepted_lower_case_and_tmpdir_too(name: str) -> None:
    assert check_env_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("A=B", id="equals-sign"),
        pytest.param("A\x00B", id="nul"),
        pytest.param("X" * 300, id="300-characters"),
        pytest.param("", id="empty"),
        pytest.param("1ABC", id="leading-digit"),
        pytest.param("A-B", id="dash"),
        pytest.param("A B", id="space"),
        pytest.param("NAMÉ", id="non-ascii"),
        pytest.param("A\nB", id="newline"),
    ],
)
def test_a_name_that_is_not_a_posix_name_is_refused_without_echoing_it(name: str) -> None:
    with pytest.raises(EnvRefusedError) as refused:
        check_env_name(name)
    assert str(refused.value) == NOT_A_NAME


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("LD_PRELOAD", f"LD_PRELOAD {LOADER}"),
        ("LD_LIBRARY_PATH", f"LD_LIBRARY_PATH {LOADER}"),
        ("LD_AUDIT", f"LD_AUDIT {LOADER}"),
        ("GLIBC_TUNABLES", f"GLIBC_TUNABLES {LOADER}"),
        (
            "GCONV_PATH",
            "GCONV_PATH is refused: glibc's iconv (it loads modules from there) acts on it",
        ),
        (
            "NLSPATH",
            "NLSPATH is refused: glibc (it loads message catalogues from there) acts on it",
        ),
        ("RES_OPTIONS", "RES_OPTIONS is refused: glibc's resolver acts on it"),
        ("MALLOC_TRACE", "MALLOC_TRACE is refused: glibc's malloc acts on it"),
        # Names of the loader's and malloc's families beyond the list: named by prefix only.
        ("LD_" + SECRET.upper().replace("-", "_"), f"a name starting with LD_ {LOADER}"),
        ("MALLOC_ARENA_MAX", "a name starting with MALLOC_ is refused: glibc's malloc acts on it"),
    ],
)
def test_names_the_loader_or_libc_act_on_are_refused_by_name(name: str, message: str) -> None:
    with pytest.raises(EnvRefusedError) as refused:
        check_env_name(name)
    assert str(refused.value) == message


def test_values_are_bounded_one_by_one_and_together() -> None:
    at_limit = "x" * (MAX_ENTRY_BYTES - len("A=") - 1)
    assert check_env({"A": at_limit}) == {"A": at_limit}
    for env in (
        {"A": at_limit + "x"},
        {"A": "é" * (MAX_ENTRY_BYTES // 2)},  # counted in bytes, as execve counts them
        {"A": "x" * 10 * 1024 * 1024},
    ):
        with pytest.raises(EnvRefusedError, match="NAME=value is at most 131072 bytes"):
            check_env(env)
    half = "x" * (MAX_ENTRY_BYTES // 2)
    together = {f"V{i}": half for i in range(2 * MAX_ENV_BYTES // MAX_ENTRY_BYTES)}
    with pytest.raises(EnvRefusedError, match="too large together"):
        check_env(together)


def test_a_stored_message_with_values_at_the_limit_validates_again_sealed() -> None:
    # The stored copy holds its values sealed (a third larger) and is validated again when
    # it is routed: what was accepted plain must be accepted sealed.
    at_limit = "x" * (MAX_ENTRY_BYTES - len("BIG=") - 1)
    request = DispatchRequest.model_validate(dispatch(env={"BIG": at_limit, "B": "1"}))
    sealed = Sealer(TEST_SECRET_KEY).seal(request.model_dump(mode="json"), "acme", "wi-1")
    assert len(sealed["env"]["BIG"]) > MAX_ENTRY_BYTES
    assert DispatchRequest.model_validate(sealed).env["B"] != "1"


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("LD_PRELOAD", f"LD_PRELOAD {LOADER}"),
        ("LD_LIBRARY_PATH", f"LD_LIBRARY_PATH {LOADER}"),
        (
            "GCONV_PATH",
            "GCONV_PATH is refused: glibc's iconv (it loads modules from there) acts on it",
        ),
        ("GLIBC_TUNABLES", f"GLIBC_TUNABLES {LOADER}"),
        ("A=B", NOT_A_NAME),
        ("A\x00B", NOT_A_NAME),
        ("X" * 300, NOT_A_NAME),
    ],
)
def test_every_env_field_refuses_the_name_naming_the_field(name: str, said: str) -> None:
    env = {name: SECRET}
    network = {"allow_network": True, "allowed_hosts": ["api.example.test"]}
    binding = {name: {"host": "api.example.test", "value": SECRET}}
    session = {"org": "acme", "project": "p", "profile": "default", "env": env}
    refusals = {
        "env": refusal(DispatchRequest, dispatch(env=env)),
        "toolchain": refusal(DispatchRequest, dispatch(toolchain={"env": env})),
        "egress.secret_bindings": refusal(
            DispatchRequest, dispatch(egress={**network, "secret_bindings": binding})
        ),
        "session env": refusal(SessionCreate, session),
        "exec env": refusal(ExecBody, {"command": ["true"], "env": env}),
    }
    # The providers' ToolchainDemand refuses a control character in a name first.
    toolchain = "toolchain.env.*.[key]: must not contain control characters"
    assert refusals == {
        "env": f"env: {said}",
        "toolchain": toolchain if "\x00" in name else f"toolchain: toolchain.env: {said}",
        "egress.secret_bindings": f"egress.secret_bindings: {said}",
        "session env": f"env: {said}",
        "exec env": f"env: {said}",
    }
    for text in refusals.values():
        assert SECRET not in text
        assert name in said or name not in text  # a name of corral's list alone is shown


def test_a_10_mb_value_is_an_invalid_message_naming_env() -> None:
    said = refusal(DispatchRequest, dispatch(env={"BIG": "x" * 10 * 1024 * 1024}))
    assert said.startswith("env: a value is too long")


def test_ordinary_env_is_accepted_everywhere() -> None:
    env = {"CI": "true", "node_env": "ci", "TMPDIR": "/tmp/work", "CORRAL_X": "1"}
    assert DispatchRequest.model_validate(dispatch(env=env, toolchain={"env": env})).env == env
    assert SessionCreate(org="acme", project="p", profile="default", env=env).env == env
    assert ExecBody(command=["true"], env=env).env == env
