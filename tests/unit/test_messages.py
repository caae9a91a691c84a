"""The dispatch message v1: what it accepts, what it refuses, and how it says so."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from corral.providers.descriptors import BUILTIN
from corral.shared.messages import CodeWork, DispatchRequest, ShellWork, field_errors

KNOWN = ", ".join(sorted(BUILTIN))  # the providers corral has, by id

SECRET = "sk-live-9c2e-NEVER-ECHO"


def message(**fields: Any) -> dict[str, Any]:
    return {
        "org": "acme",
        "project": "web",
        "profile": "default",
        "work": {"kind": "shell", "command": "echo hi"},
    } | fields


def errors_of(raw: Any) -> list[dict[str, str]]:
    with pytest.raises(ValidationError) as raised:
        DispatchRequest.model_validate(raw)
    return field_errors(raised.value)


def fields_of(errors: list[dict[str, str]]) -> list[str]:
    return [e["field"] for e in errors]


def test_minimal_shell_message_is_valid_with_defaults() -> None:
    request = DispatchRequest.model_validate(message())
    assert request.version == 1
    assert request.work == ShellWork(command="echo hi")
    assert request.agent_card.runtime_kinds == frozenset()
    assert request.egress.allow_network is False
    assert request.egress.allowed_hosts == ()
    assert request.provider is None and request.idempotency_key is None
    assert request.needs_gpu is False


def test_code_work_carries_its_arguments() -> None:
    code = "def main(numbers, power):\n    return sum(n ** power for n in numbers)\n"
    request = DispatchRequest.model_validate(
        message(work={"kind": "code", "code": code, "arguments": {"numbers": [1, 2], "power": 2}})
    )
    assert isinstance(request.work, CodeWork)
    assert request.work.language == "python"
    assert request.work.arguments == {"numbers": [1, 2], "power": 2}
    # What intake stores validates back to the same request.
    assert DispatchRequest.model_validate(request.model_dump(mode="json")) == request


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        pytest.param(message(colour="blue"), "colour", id="top-level"),
        pytest.param(
            message(work={"kind": "shell", "command": "x", "shell": "zsh"}),
            "work.shell.shell",
            id="in-work",
        ),
        pytest.param(
            message(egress={"allow_network": True, "proxy": "p"}), "egress.proxy", id="in-egress"
        ),
        pytest.param(message(resources={"gpus": 1}), "resources.gpus", id="in-resources"),
    ],
)
def test_unknown_fields_are_refused_by_name(raw: dict[str, Any], field: str) -> None:
    errors = errors_of(raw)
    assert errors == [{"field": field, "message": "Extra inputs are not permitted"}]


def test_unknown_runtime_kind_names_the_known_ones_not_the_value() -> None:
    errors = errors_of(message(agent_card={"runtimes": [{"kind": "npm"}, {"kind": "cobol"}]}))
    assert fields_of(errors) == ["agent_card.runtimes.1.kind"]
    text = errors[0]["message"]
    assert text.startswith("unknown runtime kind; known: ") and "cobol" not in text
    assert "npm" in text and "python-pip" in text  # says what would have been accepted


@pytest.mark.parametrize("kind", ["quantum", "toolchain:", "toolchain:Go", "GPU"])
def test_unknown_requirement_kind_is_refused(kind: str) -> None:
    errors = errors_of(message(agent_card={"requires": [{"kind": "git"}, {"kind": kind}]}))
    assert fields_of(errors) == ["agent_card.requires.1.kind"]
    assert errors[0]["message"].startswith("unknown requirement kind; known: ")
    assert repr(kind) not in errors[0]["message"]


@pytest.mark.parametrize("kind", ["toolchain:go", "toolchain:node", "toolchain:rust-1.80", "git"])
def test_known_and_toolchain_requirements_are_accepted(kind: str) -> None:
    request = DispatchRequest.model_validate(message(agent_card={"requires": [{"kind": kind}]}))
    assert request.agent_card.requirement_kinds == {kind}


@pytest.mark.parametrize("org", ["", "acme corp", "-acme", "acme/web", "a" * 64, "ácme"], ids=repr)
def test_bad_org_identifier_is_refused(org: str) -> None:
    errors = errors_of(message(org=org))
    assert fields_of(errors) == ["org"]


@pytest.mark.parametrize("org", ["acme", "Acme-2.prod_eu", "a" * 63, "0"])
def test_good_org_identifiers_are_accepted(org: str) -> None:
    assert DispatchRequest.model_validate(message(org=org)).org == org


@pytest.mark.parametrize(
    ("fields", "needs_gpu"),
    [
        pytest.param({}, False, id="nothing"),
        pytest.param({"resources": {"gpu": 0, "cpu": 8}}, False, id="gpu-zero"),
        pytest.param({"resources": {"gpu": 1}}, True, id="resources-gpu"),
        pytest.param({"agent_card": {"requires": [{"kind": "gpu"}]}}, True, id="requires-gpu"),
        pytest.param({"agent_card": {"requires": [{"kind": "git"}]}}, False, id="requires-git"),
    ],
)
def test_needs_gpu(fields: dict[str, Any], needs_gpu: bool) -> None:
    assert DispatchRequest.model_validate(message(**fields)).needs_gpu is needs_gpu


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        pytest.param({"version": 2}, "version", id="version"),
        pytest.param(
            {"work": {"kind": "shell", "command": ""}}, "work.shell.command", id="empty-command"
        ),
        pytest.param({"resources": {"gpu": -1}}, "resources.gpu", id="negative-gpu"),
        pytest.param({"idempotency_key": ""}, "idempotency_key", id="empty-key"),
    ],
)
def test_other_invalid_values_name_their_field(fields: dict[str, Any], field: str) -> None:
    assert fields_of(errors_of(message(**fields))) == [field]


def test_missing_required_fields_are_each_named() -> None:
    # profile is optional: a message that names none takes `default`.
    assert sorted(fields_of(errors_of({"org": "acme"}))) == ["project", "work"]


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(
            message(env={"API_KEY": SECRET}, resources={"cpu": "lots"}),
            id="secret-in-env-bad-type-elsewhere",
        ),
        pytest.param(message(env={"API_KEY": [SECRET]}), id="secret-as-wrong-type"),
        pytest.param(message(idempotency_key=SECRET * 20), id="secret-too-long"),
        pytest.param(message(org=SECRET + " !"), id="secret-bad-pattern"),
        pytest.param(message(version=SECRET), id="secret-bad-literal"),
        pytest.param(message(env={"API_KEY": SECRET}, surprise=SECRET), id="secret-extra-field"),
    ],
)
def test_field_errors_never_include_input_values(raw: dict[str, Any]) -> None:
    errors = errors_of(raw)
    assert errors
    for error in errors:
        assert set(error) == {"field", "message"}
        assert SECRET not in error["field"] + error["message"]


def test_field_errors_leave_out_a_bad_work_kind_value() -> None:
    errors = errors_of(message(work={"kind": SECRET, "command": "x"}))
    assert fields_of(errors) == ["work"]
    assert SECRET not in errors[0]["message"]


def test_a_provider_corral_does_not_have_is_refused_with_the_known_ids() -> None:
    [error] = errors_of(message(provider="nosuch"))
    assert error["field"] == "provider"
    assert f"unknown provider; known providers: {KNOWN}" in error["message"]
    assert "nosuch" not in error["message"]  # values stay out of errors
    assert DispatchRequest.model_validate(message(provider="docker")).provider == "docker"


def test_kits_of_the_catalogue_are_accepted_and_others_refused_by_name() -> None:
    accepted = DispatchRequest.model_validate(message(toolchain={"kits": ["node@20"]}))
    assert accepted.toolchain.kits == ("node@20",)
    [error] = errors_of(message(toolchain={"kits": ["cobol@85"]}))
    assert error["field"] == "toolchain"
    assert error["message"].startswith("toolchain.kits: unknown kit cobol; known: go@1.22")
    assert DispatchRequest.model_validate(message(toolchain={"kits": []})).toolchain.kits == ()


GIT = {"url": "https://git.example.com/acme/web.git", "ref": "main"}


def test_a_git_input_and_a_review_are_accepted_and_imply_a_bundle() -> None:
    request = DispatchRequest.model_validate(
        message(inputs={"git": GIT}, egress={"allow_network": True}, review={"required": True})
    )
    assert request.inputs.git is not None and request.inputs.git.ref == "main"
    assert request.collects_bundle and not request.bundle
    assert not DispatchRequest.model_validate(message()).collects_bundle
    local = {"url": "file:///srv/git/web.git", "ref": "v1.2"}
    assert DispatchRequest.model_validate(message(inputs={"git": local})).inputs.git is not None
    ssh = {"url": "ssh://git@git.example.com/acme/web.git", "ref": "feature/x"}
    assert DispatchRequest.model_validate(
        message(inputs={"git": ssh}, egress={"allow_network": True})
    ).inputs.git


@pytest.mark.parametrize(
    ("git", "words"),
    [
        ({"url": f"https://x:{SECRET}@git.example.com/r.git", "ref": "main"}, "credentials"),
        ({"url": f"https://{SECRET}@git.example.com/r.git", "ref": "main"}, "credentials"),
        ({"url": f"https://git.example.com/r.git?token={SECRET}", "ref": "main"}, "no query"),
        ({"url": "ftp://git.example.com/r.git", "ref": "main"}, "scheme must be one of"),
        ({"url": "git@git.example.com:r.git", "ref": "main"}, "scheme must be one of"),
        ({"url": "https://git.example.com/r.git", "ref": "--upload-pack=x"}, "pattern"),
        ({"url": "https://git.example.com/r.git", "ref": "a..b"}, "'..'"),
        ({"url": "https://git.example.com/r.git", "ref": "a b"}, "pattern"),
    ],
)
def test_a_bad_git_input_is_refused_without_echoing_it(git: dict[str, str], words: str) -> None:
    errors = errors_of(message(inputs={"git": git}, egress={"allow_network": True}))
    assert len(errors) == 1 and words in errors[0]["message"], errors
    assert errors[0]["field"].startswith("inputs.git.")
    assert SECRET not in str(errors)


def test_a_git_input_over_the_network_needs_network() -> None:
    errors = errors_of(message(inputs={"git": GIT}))
    assert "needs egress.allow_network: true" in errors[0]["message"]
    assert fields_of(errors_of(message(review={"required": "maybe"}))) == ["review.required"]
    assert fields_of(errors_of(message(inputs={"tarball": "x"}))) == ["inputs.tarball"]
