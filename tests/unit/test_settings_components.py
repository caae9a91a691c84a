"""The settings are declared per component and combined in CoreSettings, which must keep
every field, default, description, validator and environment variable it had as one class."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from corral.shared.settings import (
    COMPONENTS,
    ApiSettings,
    CommonSettings,
    CoreSettings,
    IntakeSettings,
    ReaperSettings,
    component_name,
    declared_in,
)

# Every environment variable CoreSettings read when it was one class: none may go or change.
ENVIRONMENT = {
    "CORRAL_STATE_DIR",
    "CORRAL_SECRET_KEY",
    "CORRAL_SECRET_KEY_PREVIOUS",
    "CORRAL_DATABASE_URL",
    "CORRAL_DB_POOL_SIZE",
    "CORRAL_DB_POOL_TIMEOUT_S",
    "CORRAL_DB_PING_IDLE_S",
    "CORRAL_BROKER_URL",
    "CORRAL_BROKER_KEY_PREFIX",
    "CORRAL_BROKER_START_TIMEOUT_S",
    "CORRAL_CONTROL_URL",
    "CORRAL_API_URL",
    "CORRAL_API_HOST",
    "CORRAL_API_PORT",
    "CORRAL_API_SOCKET",
    "CORRAL_API_METRICS_HOST",
    "CORRAL_API_METRICS_PORT",
    "CORRAL_API_PROCESSES",
    "CORRAL_END_BATCH_S",
    "CORRAL_API_BODY_LIMIT_DISPATCH",
    "CORRAL_API_BODY_LIMIT_COMPLETE",
    "CORRAL_API_BODY_LIMIT_LOGS",
    "CORRAL_API_BODY_LIMIT_DEFAULT",
    "CORRAL_API_JSON_MAX_DEPTH",
    "CORRAL_BUNDLE_MAX_BYTES",
    "CORRAL_BUNDLE_MAX_MANIFEST_BYTES",
    "CORRAL_BUNDLE_MAX_PATCHES",
    "CORRAL_BUNDLE_STORE",
    "CORRAL_BUNDLE_INLINE_MAX_BYTES",
    "CORRAL_BUNDLE_DIR",
    "CORRAL_BUNDLE_S3_BUCKET",
    "CORRAL_BUNDLE_S3_PREFIX",
    "CORRAL_BUNDLE_S3_ENDPOINT_URL",
    "CORRAL_BUNDLE_S3_REGION",
    "CORRAL_LOG_BUDGET_BYTES",
    "CORRAL_LOG_BUDGET_LINES",
    "CORRAL_SANDBOX_NETWORK",
    "CORRAL_SANDBOX_NETWORK_EXCEPT_ORGS",
    "CORRAL_EGRESS_OPEN_NETWORKS",
    "CORRAL_EGRESS_UPSTREAM_CA_FILE",
    "CORRAL_WEBHOOK_ALLOW_HTTP",
    "CORRAL_WEBHOOK_OPEN_NETWORKS",
    "CORRAL_RUNNER_RATE_PER_S",
    "CORRAL_RUNNER_RATE_BURST",
    "CORRAL_RUNNER_ADDRESS_RATE_PER_S",
    "CORRAL_RUNNER_ADDRESS_BURST",
    "CORRAL_REGISTER_RATE_PER_S",
    "CORRAL_REGISTER_BURST",
    "CORRAL_TOKEN_TTL_S",
    "CORRAL_HEARTBEAT_INTERVAL_S",
    "CORRAL_HEARTBEAT_TIMEOUT_S",
    "CORRAL_SESSION_TTL_S",
    "CORRAL_INTERACTIVE_IDLE_TTL_S",
    "CORRAL_INTERACTIVE_IDLE_TTL_MAX_S",
    "CORRAL_INTERACTIVE_TTL_S",
    "CORRAL_INTERACTIVE_TTL_MAX_S",
    "CORRAL_INTERACTIVE_EXEC_TIMEOUT_S",
    "CORRAL_INTERACTIVE_EXEC_TIMEOUT_MAX_S",
    "CORRAL_INTERACTIVE_OUTPUT_MAX_BYTES",
    "CORRAL_INTERACTIVE_FILE_MAX_BYTES",
    "CORRAL_API_KEY_CACHE_TTL_S",
    "CORRAL_ADMIN_TOKEN",
    "CORRAL_API_KEY",
    "CORRAL_PROVISION_MAX_RETRIES",
    "CORRAL_PROVISION_BACKOFF_S",
    "CORRAL_PROVISION_BACKOFF_MAX_S",
    "CORRAL_PROVISION_BATCH_WAIT_S",
    "CORRAL_PROVISION_LEASE_S",
    "CORRAL_BUDGET_CHECK_INTERVAL_S",
    "CORRAL_BREAKER_FAILURES",
    "CORRAL_BREAKER_WINDOW_S",
    "CORRAL_BREAKER_COOLDOWN_S",
    "CORRAL_BREAKER_PROBE_TIMEOUT_S",
    "CORRAL_TASK_EVENTS",
    "CORRAL_REDRIVE_INTERVAL_S",
    "CORRAL_WARM_INTERVAL_S",
    "CORRAL_WARM_WAIT_S",
    "CORRAL_WARM_POLL_S",
    "CORRAL_REDRIVE_BATCH",
    "CORRAL_REAPER_INTERVAL_S",
    "CORRAL_REAPER_BATCH",
    "CORRAL_REAPER_LOCK_TTL_S",
    "CORRAL_RECONCILE_INTERVAL_S",
    "CORRAL_PROVISION_TIMEOUT_S",
    "CORRAL_FINISH_GRACE_S",
    "CORRAL_END_LOG_TIMEOUT_S",
    "CORRAL_MAX_ATTEMPTS",
    "CORRAL_INTAKE_BATCH",
    "CORRAL_INTAKE_LEASE_S",
    "CORRAL_MAX_MESSAGE_BYTES",
    "CORRAL_MAX_MESSAGE_BODY_BYTES",
    "CORRAL_MAX_MESSAGE_DEPTH",
    "CORRAL_LOG_FORMAT",
    "CORRAL_LOG_LEVEL",
    "CORRAL_METRICS_ORG_LABELS",
    "CORRAL_PROVIDER_CONFIG",
    "CORRAL_PROVIDER_CONFIG_REFRESH_S",
    "CORRAL_DB_AUTO_UPGRADE",
    # Added since, by the issues that needed them:
    "CORRAL_ITEM_IMAGES",
    "CORRAL_RESULT_BACKEND",
    "CORRAL_CALLBACK_QUEUES",
    "CORRAL_OUTCOME_INTERVAL_S",
    "CORRAL_OUTCOME_COST_WAIT_S",
    "CORRAL_OUTCOME_MAX_ATTEMPTS",
    "CORRAL_CONSOLE_INSECURE_COOKIE",
    "CORRAL_COST_UNIT",
    "CORRAL_ROUTED_TTL_S",
    "CORRAL_PRIORITY_AGING_S",
    "CORRAL_WEBHOOK_LOG_KEEP_S",
    "CORRAL_OUTCOME_CLAIM_S",
}


def _own_fields(component: type[CommonSettings]) -> set[str]:
    return set(vars(component).get("__annotations__", {}))


def test_the_environment_variables_are_those_of_the_one_class() -> None:
    prefix = CoreSettings.model_config.get("env_prefix")
    assert prefix == "CORRAL_"
    assert {f"{prefix}{name}".upper() for name in CoreSettings.model_fields} == ENVIRONMENT
    for component in COMPONENTS:
        assert component.model_config == CoreSettings.model_config


def test_core_settings_has_the_union_of_the_components_fields() -> None:
    union = set().union(*(c.model_fields for c in COMPONENTS))
    assert set(CoreSettings.model_fields) == union
    assert _own_fields(CoreSettings) == set()  # it declares nothing of its own


def test_each_field_is_declared_in_exactly_one_component() -> None:
    declared = [name for component in COMPONENTS for name in _own_fields(component)]
    assert len(declared) == len(set(declared)) == len(CoreSettings.model_fields)
    for name in CoreSettings.model_fields:
        assert name in _own_fields(declared_in(name))
    with pytest.raises(KeyError):
        declared_in("no_such_setting")


def test_a_field_is_the_same_in_its_component_and_in_core_settings() -> None:
    # Default, factory, description and constraints (gt, le...) all survive inheritance.
    for name, combined in CoreSettings.model_fields.items():
        own = declared_in(name).model_fields[name]
        assert repr(combined) == repr(own), name
        assert combined.default_factory is own.default_factory


def test_the_validators_run_in_core_settings_and_in_their_components() -> None:
    for cls in (CoreSettings, CommonSettings):
        with pytest.raises(ValidationError, match="CORRAL_BROKER_KEY_PREFIX"):
            cls(broker_url="amqp://host:5672/", broker_key_prefix="a:")
        with pytest.raises(ValidationError, match="CORRAL_EGRESS_OPEN_NETWORKS"):
            cls(egress_open_networks="not a rule at all")
    with pytest.raises(ValidationError):
        ReaperSettings(reaper_batch=0)  # a constraint of the field, kept in its component


def test_a_component_and_core_settings_read_the_same_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CORRAL_REAPER_BATCH", "7")
    monkeypatch.setenv("CORRAL_SANDBOX_NETWORK", "deny")
    monkeypatch.setenv("CORRAL_API_PORT", "9123")
    monkeypatch.setenv("CORRAL_BUNDLE_MAX_BYTES", "1000")
    core = CoreSettings()
    assert core.reaper_batch == ReaperSettings().reaper_batch == 7
    assert core.network_allowed("acme") is IntakeSettings().network_allowed("acme") is False
    api = ApiSettings()
    assert core.api_port == api.api_port == 9123
    assert core.bundle_body_limit() == api.bundle_body_limit() == 1000 + 10 + 1024 * 1024


def test_an_invalid_setting_is_a_settings_error_whichever_class_read_it() -> None:
    from pydantic import BaseModel

    from corral.cli.main import is_settings_error, settings_errors

    class Other(BaseModel):
        number: int

    for cls in (CoreSettings, ReaperSettings):
        with pytest.raises(ValidationError) as refused:
            cls(reaper_batch=0)
        assert is_settings_error(refused.value)
        assert settings_errors(refused.value) == [
            "CORRAL_REAPER_BATCH: Input should be greater than 0"
        ]
    with pytest.raises(ValidationError) as other:
        Other(number="x")  # type: ignore[arg-type]
    assert not is_settings_error(other.value)


def test_components_have_short_names() -> None:
    names = [component_name(c) for c in COMPONENTS]
    assert names[0] == "common"
    assert "reaper" in names and "intake" in names
    assert len(names) == len(set(names))
