"""Configs are closed to unknown keys, and secrets never show in repr or stored JSON."""

from __future__ import annotations

import json

import pytest
from pydantic import SecretStr, ValidationError

from corral.providers.config import ProviderConfig, parse_model
from corral.providers.errors import InvalidProviderConfigError
from corral.providers.local.provider import LocalProvider, LocalProviderConfig
from tests.conftest import SpecFactory


class ApiConfig(ProviderConfig):
    endpoint: str
    api_key: SecretStr


def test_secret_config_fields_are_masked_in_repr_and_redacted_json() -> None:
    config = ApiConfig(endpoint="https://api.example.test", api_key=SecretStr("sk-live-123"))
    assert "sk-live-123" not in repr(config)
    assert "sk-live-123" not in json.dumps(config.redacted())
    assert config.redacted()["endpoint"] == "https://api.example.test"
    assert config.api_key.get_secret_value() == "sk-live-123"


def test_schema_marks_secret_fields_write_only() -> None:
    schema = ApiConfig.model_json_schema()
    assert schema["properties"]["api_key"]["writeOnly"] is True
    assert schema["additionalProperties"] is False


def test_spec_hides_the_token_and_egress_secrets(make_spec: SpecFactory) -> None:
    spec = make_spec(
        registration_token="crt_very-secret",
        egress={
            "allow_network": True,
            "ca_cert_pem": "PEM-SECRET",
            "allowed_hosts": ["api.example.test"],
            "secret_bindings": {"API_TOKEN": {"host": "api.example.test", "value": "BOUND-SECRET"}},
        },
    )
    for rendering in (repr(spec), str(spec), spec.model_dump_json()):
        assert "crt_very-secret" not in rendering
        assert "PEM-SECRET" not in rendering
        assert "BOUND-SECRET" not in rendering
    assert spec.sandbox_env()["CORRAL_REGISTRATION_TOKEN"] == "crt_very-secret"
    assert spec.sandbox_env()["API_TOKEN"] == "corral-secret-binding:API_TOKEN"
    assert "BOUND-SECRET" not in json.dumps(spec.sandbox_env())


def test_validation_errors_name_keys_but_never_values() -> None:
    with pytest.raises(InvalidProviderConfigError) as raised:
        parse_model(ApiConfig, {"endpoint": 5, "api_kye": "sk-live-123"}, what="config for api")
    message = str(raised.value)
    assert "'api_kye'" in message
    assert "endpoint" in message
    assert "sk-live-123" not in message
    # The pace's keys are every provider's (providers/pacing.py).
    assert (
        "Allowed keys: api_key, create_burst, creates_in_flight, creates_per_s, endpoint."
        in message
    )


def test_provider_config_rejects_unknown_keys() -> None:
    with pytest.raises(InvalidProviderConfigError, match="'isolaton'"):
        LocalProvider({"isolaton": "off"})


def test_provider_config_is_frozen() -> None:
    config = LocalProviderConfig()
    with pytest.raises(ValidationError):
        config.isolation = "off"  # type: ignore[misc]


@pytest.mark.parametrize("bad_id", ["../escape", ".hidden", "a/b", "", "x" * 64])
def test_spec_ids_must_be_label_safe(make_spec: SpecFactory, bad_id: str) -> None:
    with pytest.raises(ValidationError, match="sandbox_id"):
        make_spec(sandbox_id=bad_id)


def test_handle_must_carry_the_org() -> None:
    from corral.providers.base import SandboxHandle

    with pytest.raises(ValidationError, match="org_id"):
        SandboxHandle(provider_id="local", external_id="x", metadata={})
