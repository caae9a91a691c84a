"""resolve_credential: stored credential, else environment, else a clear typed error."""

from __future__ import annotations

import pytest

from corral.providers.credentials import (
    CredentialResolver,
    InMemoryCredentialStore,
    credential_env_var,
    resolve_credential,
)
from corral.providers.errors import CredentialMissingError
from corral.shared.errors import ConfigurationError
from corral.shared.keyring import SealedElsewhereError

KEY = "tests-only-key-A1b2C3d4E5f6G7h8J9k0"
OTHER_KEY = "tests-only-key-Z9y8X7w6V5u4T3s2R1q0"


def test_stored_credential_wins_over_the_environment() -> None:
    store = InMemoryCredentialStore()
    resolver = CredentialResolver(store, secret_key=KEY, environ={"CORRAL_E2B_API_KEY": "env"})
    resolver.put("acme", "e2b", "stored-secret")
    assert resolver.resolve("acme", "e2b").get_secret_value() == "stored-secret"
    # another org has nothing stored and falls back to the environment
    assert resolver.resolve("globex", "e2b").get_secret_value() == "env"


def test_stored_credentials_are_encrypted_at_rest() -> None:
    store = InMemoryCredentialStore()
    CredentialResolver(store, secret_key=KEY, environ={}).put("acme", "e2b", "stored-secret")
    [ciphertext] = store.rows.values()
    assert b"stored-secret" not in ciphertext


def test_missing_credential_says_how_to_set_either() -> None:
    resolver = CredentialResolver(InMemoryCredentialStore(), secret_key=KEY, environ={})
    with pytest.raises(CredentialMissingError) as raised:
        resolver.resolve("acme", "e2b")
    message = str(raised.value)
    assert "CORRAL_E2B_API_KEY" in message
    assert "corral credentials set --org acme --provider e2b" in message
    assert raised.value.code == "credential_missing" and not raised.value.retryable


def test_environment_fallback_without_a_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_ACME_CLOUD_API_KEY", "from-env")
    assert resolve_credential("acme", "acme-cloud").get_secret_value() == "from-env"
    assert credential_env_var("acme-cloud") == "CORRAL_ACME_CLOUD_API_KEY"


def test_a_changed_secret_key_is_reported_not_misread() -> None:
    store = InMemoryCredentialStore()
    CredentialResolver(store, secret_key=KEY, environ={}).put("acme", "e2b", "s")
    with pytest.raises(ConfigurationError, match="key changed"):
        CredentialResolver(store, secret_key=OTHER_KEY, environ={}).resolve("acme", "e2b")


def test_storing_without_a_secret_key_explains_how_to_make_one() -> None:
    resolver = CredentialResolver(InMemoryCredentialStore(), environ={})
    with pytest.raises(ConfigurationError, match="corral secret-key"):
        resolver.put("acme", "e2b", "s")


def test_short_secret_keys_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="at least 32"):
        CredentialResolver(InMemoryCredentialStore(), secret_key="short", environ={})


def test_a_credential_copied_to_another_org_or_provider_does_not_open() -> None:
    store = InMemoryCredentialStore()
    resolver = CredentialResolver(store, secret_key=KEY, environ={})
    resolver.put("acme", "e2b", "acme-secret")
    store.rows[("globex", "e2b")] = store.rows[("acme", "e2b")]
    store.rows[("acme", "modal")] = store.rows[("acme", "e2b")]
    for org, provider in (("globex", "e2b"), ("acme", "modal")):
        with pytest.raises(SealedElsewhereError) as raised:
            resolver.resolve(org, provider)
        assert raised.value.code == "sealed_elsewhere"
        assert "acme-secret" not in str(raised.value)
    assert resolver.resolve("acme", "e2b").get_secret_value() == "acme-secret"
