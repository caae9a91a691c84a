"""Dispatch env values and secret-binding values, sealed at rest.

A dispatch message's ``env`` and ``toolchain.env`` values are often secrets, and its
``egress.secret_bindings`` values always are; "env values" below means all three. The stored
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
    """The payload's env maps (top-level and the toolchain's), and its secret bindings'
    values as a map of binding name to value, as found."""
    maps = []
    if isinstance(payload.get("env"), dict):
        maps.append(payload["env"])
    toolchain = payload.get("toolchain")
    if isinstance(toolchain, dict) and isinstance(toolchain.get("env"), dict):
        maps.append(toolchain["env"])
    bindings = _bindings(payload)
    if bindings:
        maps.append({name: binding.get("value") for name, binding in bindings.items()})
    return maps


def _bindings(payload: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The payload's ``egress.secret_bindings`` that hold a string value, as found."""
    egress = payload.get("egress")
    bindings = egress.get("secret_bindings") if isinstance(egress, dict) else None
    if not isinstance(bindings, dict):
        return {}
    return {
        name: binding
        for name, binding in bindings.items()
        if isinstance(binding, dict) and isinstance(binding.get("value"), str)
    }


def has_env_values(payload: Mapping[str, Any]) -> bool:
    return any(_env_maps(dict(payload)))


def env_values(payload: Mapping[str, Any]) -> list[str]:
    """Every env value of ``payload`` (an opened one: these are the secrets themselves), for
    redacting them from text the sandbox wrote."""
    return [
        value
        for env in _env_maps(dict(payload))
        for value in env.values()
        if isinstance(value, str)
    ]


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
    bindings = _bindings(copy)
    if bindings:
        changed = {name: {**b, "value": change(b["value"])} for name, b in bindings.items()}
        egress = copy["egress"]
        copy["egress"] = {**egress, "secret_bindings": {**egress["secret_bindings"], **changed}}
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

    def seal_text(self, text: str) -> str:
        """``text`` encrypted (a stored provider configuration, say).

        Raises:
            ConfigurationError: no secret key is configured.
        """
        return SEALED + self._require().encrypt(text).decode()

    def open_text(self, text: str) -> str:
        """``text`` decrypted if it was sealed, else as it is.

        Raises:
            ConfigurationError: it is sealed and the key is missing or another one.
        """
        if not text.startswith(SEALED):
            return text
        return self._require().decrypt(text.removeprefix(SEALED).encode())

    def _require(self) -> CredentialCipher:
        if self._cipher is None:
            raise ConfigurationError(
                "CORRAL_SECRET_KEY is not set, so dispatch env values cannot be sealed or "
                "opened; generate one with `corral secret-key` and set it on every process"
            )
        return self._cipher
