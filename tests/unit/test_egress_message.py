"""The dispatch message's egress: what it accepts, what it refuses and how it says so, how a
secret binding's value is sealed at rest, and where routing may send it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from corral.providers.base import Egress, SecretBinding
from corral.providers.egress.rules import HostRule, parse_host_rule
from corral.scheduler.admin.pools import PoolCreate
from corral.scheduler.errors import NoEligiblePoolError
from corral.scheduler.routing import Routed, route, shortfalls
from corral.shared.keyring import SEALED_V2
from corral.shared.messages import MAX_BINDING_VALUE, DispatchRequest, field_errors
from corral.shared.store.models import AuthMode
from corral.shared.store.pools import PoolView
from corral.shared.store.sealing import WITHHELD, Sealer, is_withheld, stored
from tests.conftest import TEST_SECRET_KEY

SECRET = "sk-bound-never-in-the-sandbox"
PEM = "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIU\n-----END CERTIFICATE-----\n"


def message(egress: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "org": "acme",
        "project": "web",
        "profile": "default",
        "work": {"kind": "shell", "command": "true"},
        "egress": egress,
        **fields,
    }


def bound(host: str = "api.example.test") -> dict[str, Any]:
    return {
        "allow_network": True,
        "allowed_hosts": [host],
        "secret_bindings": {"API_TOKEN": {"host": host, "value": SECRET}},
    }


@pytest.mark.parametrize(
    ("entry", "rule"),
    [
        ("pypi.org", HostRule("pypi.org")),
        ("PyPI.org:443", HostRule("pypi.org", 443)),
        ("127.0.0.1:8080", HostRule("127.0.0.1", 8080)),
        ("10.0.0.0/8", HostRule("10.0.0.0/8")),
        ("[::1]:8080", HostRule("::1", 8080)),
        ("::1", HostRule("::1")),
        ("192.168.1.7/32", HostRule("192.168.1.7")),
    ],
)
def test_host_entries_parse_to_rules(entry: str, rule: HostRule) -> None:
    assert parse_host_rule(entry) == rule


def test_a_full_egress_is_accepted_and_normalised() -> None:
    egress = {
        **bound("API.example.test:80"),
        "no_proxy": ["localhost"],
        "ca_cert_pem": PEM,
    }
    request = DispatchRequest.model_validate(message(egress))
    assert request.egress.allowed_hosts == ("api.example.test:80",)
    assert request.egress.secret_bindings["API_TOKEN"].host == "api.example.test:80"
    assert SECRET not in repr(request)


@pytest.mark.parametrize(
    ("egress", "field", "words"),
    [
        ({"allowed_hosts": ["pypi.org"]}, "egress", "need allow_network: true"),
        ({"allow_network": False, "http_proxy": "http://p:3128"}, "egress", "allow_network"),
        ({"allow_network": True, "allowed_hosts": ["bad host"]}, "egress.allowed_hosts.0", "host"),
        ({"allow_network": True, "allowed_hosts": ["a.test:0"]}, "egress.allowed_hosts.0", "port"),
        ({"allow_network": True, "allowed_hosts": ["x"] * 257}, "egress.allowed_hosts", "256"),
        ({"allow_network": True, "http_proxy": "socks5://p:1"}, "egress.http_proxy", "http://"),
        ({"allow_network": True, "ca_cert_pem": "not a pem"}, "egress.ca_cert_pem", "PEM"),
        (
            {"allow_network": True, "ca_cert_pem": PEM * 2000},
            "egress.ca_cert_pem",
            "at most 65536",
        ),
        (
            {"allow_network": True, "allowed_hosts": ["a.test"], "https_proxy": "http://p:1"},
            "egress",
            "cannot be combined with allowed_hosts",
        ),
        (
            {**bound(), "allowed_hosts": ["other.test"]},
            "egress",
            "must be one of allowed_hosts",
        ),
        (
            {**bound(), "secret_bindings": {"CORRAL_X": {"host": "a.test", "value": "v"}}},
            "egress.secret_bindings",
            "environment variable names",
        ),
        (
            {**bound(), "secret_bindings": {"T": {"host": "api.example.test", "value": "a\nb"}}},
            "egress.secret_bindings.*.value",
            "one line",
        ),
        # A network: its HTTPS requests were refused at CONNECT, the value never put in.
        (
            {
                "allow_network": True,
                "allowed_hosts": ["10.0.0.0/8"],
                "secret_bindings": {"T": {"host": "10.0.0.0/8", "value": SECRET}},
            },
            "egress.secret_bindings.*.host",
            "not a network",
        ),
        # What the proxy cannot write into a header (it dropped the connection, unanswered).
        *(
            (
                {**bound(), "secret_bindings": {"T": {"host": "api.example.test", "value": v}}},
                "egress.secret_bindings.*.value",
                "an HTTP header can carry",
            )
            for v in (f"Bearer {SECRET}\u0442", f"{SECRET}\x01", f"{SECRET}\x7f")
        ),
    ],
)
def test_malformed_egress_is_refused_naming_the_field(
    egress: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(ValidationError) as raised:
        DispatchRequest.model_validate(message(egress))
    errors = field_errors(raised.value)
    assert any(e["field"] == field and words in e["message"] for e in errors), errors
    assert SECRET not in json.dumps(errors)


def test_a_binding_name_that_is_also_an_env_name_is_refused() -> None:
    with pytest.raises(ValidationError) as raised:
        DispatchRequest.model_validate(message(bound(), env={"API_TOKEN": "x"}))
    assert "also in env" in json.dumps(field_errors(raised.value))


def test_binding_values_are_sealed_withheld_and_opened_like_env_values() -> None:
    payload = DispatchRequest.model_validate(message(bound())).model_dump(mode="json")
    sealed = Sealer(TEST_SECRET_KEY).seal(payload, "acme", "wi-1")
    assert SECRET not in json.dumps(sealed)
    assert sealed["egress"]["secret_bindings"]["API_TOKEN"]["value"].startswith(SEALED_V2)
    assert Sealer(TEST_SECRET_KEY).open(sealed, "acme", "wi-1") == payload
    kept = stored(payload, Sealer(None), "acme", "wi-1")
    assert SECRET not in json.dumps(kept) and is_withheld(kept)
    assert kept["egress"]["secret_bindings"]["API_TOKEN"]["value"] == WITHHELD


def test_a_binding_value_at_its_limit_validates_again_sealed_and_one_over_is_refused() -> None:
    # The stored message (values sealed, a third larger) is validated again when routed.
    long = {"value": "v" * MAX_BINDING_VALUE, "host": "api.example.test"}
    payload = DispatchRequest.model_validate(
        message({**bound(), "secret_bindings": {"API_TOKEN": long}})
    ).model_dump(mode="json")
    sealed = Sealer(TEST_SECRET_KEY).seal(payload, "acme", "wi-1")
    assert len(sealed["egress"]["secret_bindings"]["API_TOKEN"]["value"]) > MAX_BINDING_VALUE
    assert DispatchRequest.model_validate(sealed).egress.secret_bindings["API_TOKEN"]
    over = {**long, "value": "v" * (MAX_BINDING_VALUE + 1)}
    with pytest.raises(ValidationError) as raised:
        DispatchRequest.model_validate(message({**bound(), "secret_bindings": {"T": over}}))
    assert fields_and_messages(raised.value) == [
        ("egress.secret_bindings.*.value", f"at most {MAX_BINDING_VALUE} characters")
    ]


def fields_and_messages(error: ValidationError) -> list[tuple[str, str]]:
    return [(e["field"], e["message"]) for e in field_errors(error)]


def test_the_sandbox_env_holds_placeholders_proxies_and_the_ca_never_the_value() -> None:
    egress = Egress(
        allow_network=True,
        https_proxy="http://proxy.test:3128",
        no_proxy=("localhost", "10.0.0.1"),
        ca_cert_pem=PEM,  # type: ignore[arg-type]
        secret_bindings={
            "API_TOKEN": SecretBinding(host="a.test", value=SECRET)  # type: ignore[arg-type]
        },
    )
    env = egress.sandbox_env()
    assert env["HTTPS_PROXY"] == env["https_proxy"] == "http://proxy.test:3128"
    assert env["NO_PROXY"] == env["no_proxy"] == "localhost,10.0.0.1"
    assert env["CORRAL_CA_CERT_PEM"] == PEM
    assert env["API_TOKEN"] == SecretBinding.placeholder_for("API_TOKEN")
    assert SECRET not in json.dumps(env) and SECRET not in repr(egress)


def pool(provider_id: str, **fields: Any) -> PoolView:
    return PoolView.build(
        id=f"{provider_id}-id",
        name=f"{provider_id}-pool",
        org_id="acme",
        provider_id=provider_id,
        priority=0,
        max_concurrent=5,
        **fields,
    )


def test_an_item_with_bindings_goes_nowhere_that_cannot_substitute_them() -> None:
    request = DispatchRequest.model_validate(message(bound()))
    with pytest.raises(NoEligiblePoolError) as raised:
        route(request, AuthMode.BYOK, [pool("modal"), pool("daytona")], {})
    assert "egress.secret_bindings (they need corral's egress proxy" in str(raised.value)
    assert "modal-pool (modal)" in str(raised.value)


def test_an_override_cannot_claim_an_enforcement() -> None:
    claimed = pool("modal", capabilities={"enforces_allowed_hosts": True})
    request = DispatchRequest.model_validate(
        message({"allow_network": True, "allowed_hosts": ["pypi.org"]})
    )
    assert any("enforced egress.allowed_hosts" in gap for gap in shortfalls(request, claimed))
    with pytest.raises(ValidationError, match="cannot be overridden"):
        PoolCreate.model_validate(
            {
                "org_id": "acme",
                "name": "p",
                "provider_id": "modal",
                "capabilities": {"enforces_secret_bindings": True},
            }
        )


def test_a_code_interpreter_gets_no_item_with_proxy_or_ca_settings() -> None:
    code = {"kind": "code", "code": "def main():\n    return 1\n"}
    with_ca = DispatchRequest.model_validate(
        message({"allow_network": True, "ca_cert_pem": PEM}, work=code)
    )
    assert any("code interpreter" in gap for gap in shortfalls(with_ca, pool("agentrun")))
    plain = DispatchRequest.model_validate(message({"allow_network": True}, work=code))
    assert isinstance(route(plain, AuthMode.BYOK, [pool("agentrun")], {}), Routed)
