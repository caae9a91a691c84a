"""Provider credentials: an org's stored secret, else an environment fallback.

:func:`resolve_credential` answers, in order:

1. the org's stored credential for the provider, decrypted with the deployment's secret key
   (``CORRAL_SECRET_KEY``); stored credentials are encrypted at rest (Fernet, with a key
   derived from the secret key by HKDF-SHA256);
2. the environment variable ``CORRAL_<PROVIDER>_API_KEY`` of the worker;
3. otherwise :class:`CredentialMissingError`, saying how to set either.

Credentials come back as ``SecretStr`` so that a stray repr or log line shows a mask.
"""

from __future__ import annotations

import base64
import os
import threading
from collections.abc import Mapping
from typing import Protocol

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from pydantic import SecretStr

from corral.providers.errors import CredentialMissingError
from corral.shared.errors import ConfigurationError


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


class CredentialCipher:
    """Encrypts credentials with a key derived from the deployment's secret key."""

    def __init__(self, secret_key: SecretStr | str) -> None:
        raw = secret_key.get_secret_value() if isinstance(secret_key, SecretStr) else secret_key
        if len(raw) < 16:
            raise ConfigurationError(
                "CORRAL_SECRET_KEY must be at least 16 characters; generate one with "
                "`corral secret-key`"
            )
        derived = HKDF(
            algorithm=hashes.SHA256(), length=32, salt=None, info=b"corral provider credentials"
        ).derive(raw.encode())
        self._fernet = Fernet(base64.urlsafe_b64encode(derived))

    def encrypt(self, secret: str) -> bytes:
        return self._fernet.encrypt(secret.encode())

    def decrypt(self, ciphertext: bytes) -> str:
        try:
            return self._fernet.decrypt(ciphertext).decode()
        except InvalidToken as exc:
            raise ConfigurationError(
                "a stored credential cannot be decrypted with CORRAL_SECRET_KEY: the key "
                "changed since it was stored; store the credential again"
            ) from exc


class CredentialResolver:
    """Resolves credentials from a store and the environment, in that order.

    ``secret_key`` is the deployment's ``CORRAL_SECRET_KEY`` (the process's runtime hands it
    in); without it, stored credentials can be neither stored nor read.
    """

    def __init__(
        self,
        store: CredentialStore | None = None,
        *,
        secret_key: SecretStr | str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.store = store
        self._cipher = CredentialCipher(secret_key) if secret_key is not None else None
        self._environ = environ if environ is not None else os.environ

    def put(self, org_id: str, provider_id: str, secret: str) -> None:
        """Encrypt and store the org's credential for the provider."""
        if self.store is None:
            raise ConfigurationError("no credential store is configured to store credentials in")
        self.store.save(org_id, provider_id, self._require_cipher().encrypt(secret))

    def resolve(self, org_id: str, provider_id: str) -> SecretStr:
        """The credential for ``provider_id`` in ``org_id``.

        Raises:
            CredentialMissingError: neither a stored credential nor the environment
                variable exists; the message says how to set either.
            ConfigurationError: a stored credential exists but CORRAL_SECRET_KEY is missing
                or wrong.
        """
        ciphertext = self.store.load(org_id, provider_id) if self.store is not None else None
        if ciphertext is not None:
            return SecretStr(self._require_cipher().decrypt(ciphertext))
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

    def _require_cipher(self) -> CredentialCipher:
        if self._cipher is None:
            raise ConfigurationError(
                "CORRAL_SECRET_KEY is not set, so stored credentials cannot be encrypted or "
                "read; generate one with `corral secret-key` and set it on every process"
            )
        return self._cipher


def resolve_credential(
    org_id: str, provider_id: str, *, resolver: CredentialResolver | None = None
) -> SecretStr:
    """The org's credential for the provider; see :class:`CredentialResolver`.

    Without a resolver, the environment fallback alone is consulted.
    """
    return (resolver or CredentialResolver()).resolve(org_id, provider_id)
