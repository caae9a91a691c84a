"""Provider credentials: an org's stored secret, else an environment fallback.

:func:`resolve_credential` answers, in order:

1. the org's stored credential for the provider, opened with the deployment's secret key
   (``CORRAL_SECRET_KEY``); stored credentials are sealed at rest (corral.shared.keyring:
   AES-256-GCM under the key for credentials, bound to the org and the provider, so that a
   ciphertext copied to another org's row does not open);
2. the environment variable ``CORRAL_<PROVIDER>_API_KEY`` of the worker;
3. otherwise :class:`CredentialMissingError`, saying how to set either.

Credentials come back as ``SecretStr`` so that a stray repr or log line shows a mask.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Protocol

from pydantic import SecretStr

from corral.providers.errors import CredentialMissingError
from corral.shared.errors import ConfigurationError
from corral.shared.keyring import Keyring, Purpose


def credential_env_var(provider_id: str) -> str:
    """``CORRAL_<PROVIDER>_API_KEY``, with the id upper-cased and dashes as underscores."""
    return f"CORRAL_{provider_id.upper().replace('-', '_')}_API_KEY"


class CredentialStore(Protocol):
    """Where encrypted credentials are kept. Stores only ever see ciphertext."""

    def load(self, org_id: str, provider_id: str) -> bytes | None: ...

    def save(self, org_id: str, provider_id: str, ciphertext: bytes) -> None: ...


class InMemoryCredentialStore:
    """A dict of ciphertexts, for tests and the embedded default."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], bytes] = {}
        self._lock = threading.Lock()

    def load(self, org_id: str, provider_id: str) -> bytes | None:
        return self.rows.get((org_id, provider_id))

    def save(self, org_id: str, provider_id: str, ciphertext: bytes) -> None:
        with self._lock:
            self.rows[(org_id, provider_id)] = ciphertext


class CredentialResolver:
    """Resolves credentials from a store and the environment, in that order.

    ``keyring`` holds the deployment's ``CORRAL_SECRET_KEY`` (and its previous keys: the
    process's runtime hands it in; ``secret_key`` makes one of a key alone); without it,
    stored credentials can be neither stored nor read.
    """

    def __init__(
        self,
        store: CredentialStore | None = None,
        *,
        secret_key: SecretStr | str | None = None,
        keyring: Keyring | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.store = store
        if keyring is None and secret_key is not None:
            keyring = Keyring(secret_key)
        self._keyring = keyring
        self._environ = environ if environ is not None else os.environ

    def put(self, org_id: str, provider_id: str, secret: str) -> None:
        """Encrypt and store the org's credential for the provider."""
        if self.store is None:
            raise ConfigurationError("no credential store is configured to store credentials in")
        sealed = self._require_keyring().seal(secret, Purpose.CREDENTIAL, org_id, provider_id)
        self.store.save(org_id, provider_id, sealed.encode())

    def resolve(self, org_id: str, provider_id: str) -> SecretStr:
        """The credential for ``provider_id`` in ``org_id``.

        Raises:
            CredentialMissingError: neither a stored credential nor the environment
                variable exists; the message says how to set either.
            ConfigurationError: a stored credential exists but CORRAL_SECRET_KEY is missing
                or wrong, or it was sealed for another org or provider (copied there:
                :class:`~corral.shared.keyring.SealedElsewhereError`).
        """
        ciphertext = self.store.load(org_id, provider_id) if self.store is not None else None
        if ciphertext is not None:
            keyring = self._require_keyring()
            opened = keyring.open(ciphertext.decode(), Purpose.CREDENTIAL, org_id, provider_id)
            return SecretStr(opened)
        variable = credential_env_var(provider_id)
        value = self._environ.get(variable)
        if value:
            return SecretStr(value)
        raise CredentialMissingError(
            f"no {provider_id} credential for org {org_id!r}: store one for the org with "
            f"`corral credentials set --org {org_id} --provider {provider_id}` (reads the "
            f"secret from standard input), or set {variable} in the provider workers' "
            "environment"
        )

    def environment_credential(self, provider_id: str) -> SecretStr | None:
        """The deployment-wide fallback ``CORRAL_<PROVIDER>_API_KEY`` alone, if set (for
        calls that belong to no org, such as listing a deployment's sandboxes)."""
        value = self._environ.get(credential_env_var(provider_id))
        return SecretStr(value) if value else None

    def _require_keyring(self) -> Keyring:
        if self._keyring is None:
            raise ConfigurationError(
                "CORRAL_SECRET_KEY is not set, so stored credentials cannot be encrypted or "
                "read; generate one with `corral secret-key` and set it on every process"
            )
        return self._keyring


def resolve_credential(
    org_id: str, provider_id: str, *, resolver: CredentialResolver | None = None
) -> SecretStr:
    """The org's credential for the provider; see :class:`CredentialResolver`.

    Without a resolver, the environment fallback alone is consulted.
    """
    return (resolver or CredentialResolver()).resolve(org_id, provider_id)
