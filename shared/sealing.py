"""Dispatch env values, sealed at rest.

A dispatch message's ``env`` and ``toolchain.env`` values are often secrets. The stored
copy of the message (``work_items.payload``) holds each value encrypted with the
deployment's ``CORRAL_SECRET_KEY`` (the key that encrypts provider credentials, through the
same HKDF-derived Fernet cipher), as ``corral-sealed:v1:<token>``; only the two places that
hand them on open them: the provision path (into the sandbox's spec) and the runner's claim
answer. Names stay readable; values never are, in the database or in anything read from it.

Without a secret key nothing can be sealed, so a message that carries env values is refused
(``secret_key_missing``) and stored with its values withheld.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import SecretStr

from corral.providers.credentials import CredentialCipher
from corral.shared.errors import ConfigurationError, SecretKeyMismatchError

SEALED = "corral-sealed:v1:"
WITHHELD = "[withheld: no CORRAL_SECRET_KEY to seal it]"
MISMATCH = (
    "the work item's env values were sealed with another CORRAL_SECRET_KEY: the key "
    "changed while the item was in flight. Restore the previous CORRAL_SECRET_KEY on every "
    "process (api, scheduler, workers) to run such items, or dispatch the item again "
    "(items dispatched after the change are sealed with the new key)"
)


def _env_maps(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The payload's env maps (top-level and the toolchain's), as found."""
    maps = []
    if isinstance(payload.get("env"), dict):
        maps.append(payload["env"])
    toolchain = payload.get("toolchain")
    if isinstance(toolchain, dict) and isinstance(toolchain.get("env"), dict):
        maps.append(toolchain["env"])
    return maps


def has_env_values(payload: Mapping[str, Any]) -> bool:
    return any(_env_maps(dict(payload)))


def _mapped(payload: Mapping[str, Any], change: Callable[[str], str]) -> dict[str, Any]:
    copy = {**payload}
    if isinstance(copy.get("env"), dict):
        copy["env"] = {name: change(value) for name, value in copy["env"].items()}
    toolchain = copy.get("toolchain")
    if isinstance(toolchain, dict) and isinstance(toolchain.get("env"), dict):
        copy["toolchain"] = {
            **toolchain,
            "env": {name: change(value) for name, value in toolchain["env"].items()},
        }
    return copy


def withheld(payload: Mapping[str, Any]) -> dict[str, Any]:
    """``payload`` with every env value replaced by a note that it was not kept."""
    return _mapped(payload, lambda _: WITHHELD)


def is_withheld(payload: Mapping[str, Any]) -> bool:
    """Whether env values of ``payload`` were withheld (it cannot be run as sent)."""
    return any(WITHHELD in env.values() for env in _env_maps(dict(payload)))


def stored(payload: Mapping[str, Any], sealer: Sealer) -> dict[str, Any]:
    """A dispatch message as it is stored: env values sealed, or withheld without a key."""
    if not has_env_values(payload):
        return dict(payload)
    return sealer.seal(payload) if sealer.can_seal else withheld(payload)


class Sealer:
    """Seals and opens a payload's env values with the deployment's secret key."""

    def __init__(self, secret_key: SecretStr | str | None) -> None:
        self._cipher = CredentialCipher(secret_key) if secret_key is not None else None

    @property
    def can_seal(self) -> bool:
        return self._cipher is not None

    def seal(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """``payload`` with its env values encrypted.

        Raises:
            ConfigurationError: it has env values and no secret key is configured.
        """
        if not has_env_values(payload):
            return dict(payload)
        cipher = self._require()
        return _mapped(payload, lambda value: SEALED + cipher.encrypt(value).decode())

    def open(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """``payload`` with its sealed env values decrypted (others are left as they are).

        Raises:
            SecretKeyMismatchError: a value is sealed and the key is missing or another one (the
                key changed while the item was in flight); the item cannot run as sent.
        """
        if not has_env_values(payload):
            return dict(payload)

        def opened(value: str) -> str:
            if not value.startswith(SEALED):
                return value
            if self._cipher is None:
                raise SecretKeyMismatchError(
                    "the work item's env values are sealed, and this process has no "
                    "CORRAL_SECRET_KEY to open them: set the key the api and scheduler "
                    "sealed them with on every process, then dispatch the item again"
                )
            try:
                return self._cipher.decrypt(value.removeprefix(SEALED).encode())
            except ConfigurationError as exc:
                raise SecretKeyMismatchError(MISMATCH) from exc

        return _mapped(payload, opened)

    def _require(self) -> CredentialCipher:
        if self._cipher is None:
            raise ConfigurationError(
                "CORRAL_SECRET_KEY is not set, so dispatch env values cannot be sealed or "
                "opened; generate one with `corral secret-key` and set it on every process"
            )
        return self._cipher
