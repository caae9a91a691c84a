"""Providers and their credentials as operators administer them, through the admin api and
the CLI: what each provider is (capabilities, the JSON schema of its configuration and of
its per-sandbox options), the deployment's stored configuration of it, an org's
credentials (names only, never a secret), and a health check that uses what a worker of
this deployment would use."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from corral.providers.base import ProviderHealth
from corral.providers.config import describe_validation_error
from corral.providers.credentials import CredentialResolver
from corral.providers.errors import ProviderError
from corral.providers.registry import ProviderInfo, default_registry
from corral.scheduler.admin.pools import AdminError
from corral.shared.errors import CorralError
from corral.shared.keyring import keyring_of
from corral.shared.runtime import Runtime
from corral.shared.store import provider_configs
from corral.shared.store.credential_store import SqlCredentialStore


class UnknownProviderAdminError(AdminError, LookupError):
    """No provider has that id."""

    code = "unknown_provider"


def _require_known(provider_id: str) -> None:
    if not default_registry.is_known(provider_id):
        # The id is not echoed: the api's error answers never repeat what a client sent.
        raise UnknownProviderAdminError(
            f"unknown provider; known providers: {', '.join(default_registry.known_ids())}"
        )


def provider_row(info: ProviderInfo) -> dict[str, Any]:
    return {
        "id": info.provider_id,
        "display_name": info.display_name,
        "source": info.source,
        "sdk_installed": info.sdk_installed,
        "capabilities": info.capabilities.model_dump(mode="json") if info.capabilities else None,
        "problem": info.problem,
    }


def list_providers() -> list[dict[str, Any]]:
    """Every known provider, with its capabilities and whether its SDK is installed here."""
    return [provider_row(info) for info in default_registry.describe()]


def provider_schema(provider_id: str) -> dict[str, Any]:
    """The JSON schemas of the provider's configuration and per-sandbox options.

    Raises:
        UnknownProviderAdminError: no such provider.
        AdminError: its SDK is not installed here (the message names the extra).
    """
    _require_known(provider_id)
    try:
        descriptor = default_registry.descriptor(provider_id)
        return {
            "provider": provider_id,
            "display_name": descriptor.display_name,
            "config": descriptor.config_model.model_json_schema(),
            "options": descriptor.options_model.model_json_schema(),
        }
    except ProviderError as exc:
        raise AdminError(exc.message) from exc


def config_document(rt: Runtime, provider_id: str) -> dict[str, Any]:
    """The provider's configuration as this deployment's workers use it, secrets masked.

    Raises:
        UnknownProviderAdminError: no such provider.
    """
    _require_known(provider_id)
    effective = provider_configs.effective_config(rt.db, rt.settings, provider_id)
    return {
        "provider": provider_id,
        "source": effective.source,
        "config": _redacted(provider_id, effective.config),
        "updated_at": effective.updated_at.isoformat() if effective.updated_at else None,
    }


def _redacted(provider_id: str, config: dict[str, Any]) -> dict[str, Any]:
    try:
        return (
            default_registry.descriptor(provider_id).config_model.model_validate(config).redacted()
        )
    except (ProviderError, ValidationError):
        # Not checkable here (SDK missing) or invalid: show the keys only, never the values.
        return dict.fromkeys(config, "**********")


def set_config(rt: Runtime, provider_id: str, config: dict[str, Any]) -> dict[str, Any]:
    """Validate ``config`` against the provider's config model and store it; every process
    uses it from its next provision after ``CORRAL_PROVIDER_CONFIG_REFRESH_S``.

    Raises:
        UnknownProviderAdminError: no such provider.
        AdminError: invalid for the provider (naming the keys, not the values), or the
            provider cannot be loaded here to check it.
    """
    _require_known(provider_id)
    try:
        model = default_registry.descriptor(provider_id).config_model
    except ProviderError as exc:
        raise AdminError(exc.message) from exc
    try:
        model.model_validate(config)
    except ValidationError as exc:
        raise AdminError(
            describe_validation_error(model, exc, what=f"configuration for provider {provider_id}")
        ) from exc
    secrets = _secret_fields(model) & {key for key, value in config.items() if value}
    if secrets and not rt.db.sealer.can_seal:
        raise AdminError(
            f"the configuration sets secret fields ({', '.join(sorted(secrets))}) and "
            "CORRAL_SECRET_KEY is not set, so they cannot be stored encrypted; set the key "
            "(`corral secret-key` makes one) or pass the secrets by the environment"
        )
    provider_configs.store(rt.db, provider_id, config)
    return config_document(rt, provider_id)


def _secret_fields(model: type[BaseModel]) -> set[str]:
    return {
        name for name, field in model.model_fields.items() if "SecretStr" in str(field.annotation)
    }


def remove_config(rt: Runtime, provider_id: str) -> dict[str, Any]:
    """Forget the stored configuration: the environment's (or the defaults) apply again.

    Raises:
        UnknownProviderAdminError: no such provider.
    """
    _require_known(provider_id)
    provider_configs.remove(rt.db, provider_id)
    return config_document(rt, provider_id)


def check_provider(rt: Runtime, provider_id: str, org_id: str | None = None) -> ProviderHealth:
    """Build the provider as a worker of this deployment would now (the stored
    configuration, else ``CORRAL_PROVIDER_CONFIG``; the stored credentials) and run its
    health check: one authenticated, read-only call, with ``org_id``'s credential when
    given. A configuration the provider refuses is unhealthy, with the reason.

    Raises:
        UnknownProviderAdminError: no such provider.
    """
    _require_known(provider_id)
    config = provider_configs.effective_config(rt.db, rt.settings, provider_id)
    try:
        provider = rt.build_provider(provider_id, config.config)
    except CorralError as exc:
        source = {"stored": "stored", "environment": "CORRAL_PROVIDER_CONFIG's"}.get(
            config.source, "default"
        )
        return ProviderHealth(
            healthy=False, message=f"the {source} configuration is refused: {exc.message}"
        )
    try:
        return provider.health_check(org_id=org_id)
    except CorralError as exc:
        return ProviderHealth(healthy=False, message=exc.message)


# -- credentials ---------------------------------------------------------------------------


def set_credential(rt: Runtime, org_id: str, provider_id: str, secret: str) -> None:
    """Encrypt and store the org's credential for the provider.

    Raises:
        UnknownProviderAdminError: no such provider.
        ConfigurationError: no CORRAL_SECRET_KEY to encrypt it with.
    """
    _require_known(provider_id)
    resolver = CredentialResolver(SqlCredentialStore(rt.db.engine), keyring=keyring_of(rt.settings))
    resolver.put(org_id, provider_id, secret)


def list_credentials(rt: Runtime, org_id: str) -> list[dict[str, Any]]:
    """The providers the org has a stored credential for, and when it was stored."""
    return [
        {"provider": provider_id, "updated_at": at.isoformat()}
        for provider_id, at in SqlCredentialStore(rt.db.engine).names(org_id)
    ]


def delete_credential(rt: Runtime, org_id: str, provider_id: str) -> bool:
    """Forget the org's credential for the provider; whether there was one."""
    return SqlCredentialStore(rt.db.engine).delete(org_id, provider_id)
