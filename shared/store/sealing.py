"""Dispatch env values and secret-binding values, sealed at rest.

A dispatch message's ``env`` and ``toolchain.env`` values are often secrets, and its
``egress.secret_bindings`` values always are; "env values" below means all three. The stored
copy of the message (``work_items.payload``) holds each value sealed by
:mod:`corral.shared.keyring` (the key for env values, derived from the deployment's
``CORRAL_SECRET_KEY``), bound to the item's org, the item and the value's field (``env.NAME``,
``toolchain.env.NAME``, ``egress.secret_bindings.NAME``): a value copied into another item's
payload does not open there (``sealed_elsewhere``). Only the places that hand them on open
them: the provision path (into the sandbox's spec) and the runner's claim answer. Names stay
readable; values never are, in the database or in anything read from it.

Without a secret key nothing can be sealed, so a message that carries env values is refused
(``secret_key_missing``) and stored with its values withheld.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import SecretStr

from corral.shared.errors import ConfigurationError, SecretKeyMismatchError
from corral.shared.keyring import Keyring, Purpose, is_sealed

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


def _mapped(payload: Mapping[str, Any], change: Callable[[str, str], str]) -> dict[str, Any]:
    """``payload`` with ``change(field, value)`` for each env value; ``field`` is where the
    value is (``env.NAME``, ``toolchain.env.NAME``, ``egress.secret_bindings.NAME``)."""
    copy = {**payload}
    if isinstance(copy.get("env"), dict):
        copy["env"] = {name: change(f"env.{name}", v) for name, v in copy["env"].items()}
    toolchain = copy.get("toolchain")
    if isinstance(toolchain, dict) and isinstance(toolchain.get("env"), dict):
        copy["toolchain"] = {
            **toolchain,
            "env": {
                name: change(f"toolchain.env.{name}", v) for name, v in toolchain["env"].items()
            },
        }
    bindings = _bindings(copy)
    if bindings:
        changed = {
            name: {**b, "value": change(f"egress.secret_bindings.{name}", b["value"])}
            for name, b in bindings.items()
        }
        egress = copy["egress"]
        copy["egress"] = {**egress, "secret_bindings": {**egress["secret_bindings"], **changed}}
    return copy


def withheld(payload: Mapping[str, Any]) -> dict[str, Any]:
    """``payload`` with every env value replaced by a note that it was not kept."""
    return _mapped(payload, lambda _field, _value: WITHHELD)


def is_withheld(payload: Mapping[str, Any]) -> bool:
    """Whether env values of ``payload`` were withheld (it cannot be run as sent)."""
    return any(WITHHELD in env.values() for env in _env_maps(dict(payload)))


def stored(payload: Mapping[str, Any], sealer: Sealer, org_id: str, item_id: str) -> dict[str, Any]:
    """A dispatch message as it is stored for item ``item_id`` of ``org_id``: env values
    sealed (bound to the org, the item and their field), or withheld without a key."""
    if not has_env_values(payload):
        return dict(payload)
    return sealer.seal(payload, org_id, item_id) if sealer.can_seal else withheld(payload)


def resealed(
    payload: Mapping[str, Any], keyring: Keyring, org_id: str, item_id: str
) -> dict[str, Any] | None:
    """``payload`` with each value that depends on an old key or format sealed again under
    the current key, in its place; None when none does (key rotation).

    Raises:
        SecretKeyMismatchError: such a value cannot be opened (no key it was sealed with, or
            it does not belong here).
    """
    changed = False

    def again(field: str, value: str) -> str:
        nonlocal changed
        if not is_sealed(value) or not keyring.needs_reseal(value):
            return value
        changed = True
        opened = keyring.open(value, Purpose.ENV, org_id, item_id, field)
        return keyring.seal(opened, Purpose.ENV, org_id, item_id, field)

    copy = _mapped(payload, again)
    return copy if changed else None


class Sealer:
    """Seals and opens a payload's env values with the deployment's keyring."""

    def __init__(
        self, secret_key: SecretStr | str | None = None, *, keyring: Keyring | None = None
    ) -> None:
        if keyring is None and secret_key is not None:
            keyring = Keyring(secret_key)
        self.keyring = keyring

    @property
    def can_seal(self) -> bool:
        return self.keyring is not None

    def seal(self, payload: Mapping[str, Any], org_id: str, item_id: str) -> dict[str, Any]:
        """``payload`` with its env values sealed, each bound to ``org_id``, ``item_id`` and
        its field.

        Raises:
            ConfigurationError: it has env values and no secret key is configured.
        """
        if not has_env_values(payload):
            return dict(payload)
        keyring = self._require()
        return _mapped(
            payload,
            lambda field, value: keyring.seal(value, Purpose.ENV, org_id, item_id, field),
        )

    def open(self, payload: Mapping[str, Any], org_id: str, item_id: str) -> dict[str, Any]:
        """``payload`` (item ``item_id`` of ``org_id``'s) with its sealed env values opened
        (others are left as they are).

        Raises:
            SecretKeyMismatchError: a value is sealed and the key is missing or another one (the
                key changed while the item was in flight); the item cannot run as sent.
            SealedElsewhereError: a value was sealed for another org, item or field (copied
                there); the item cannot run as sent.
        """
        if not has_env_values(payload):
            return dict(payload)

        def opened(field: str, value: str) -> str:
            if not is_sealed(value):
                return value
            if self.keyring is None:
                raise SecretKeyMismatchError(
                    "the work item's env values are sealed, and this process has no "
                    "CORRAL_SECRET_KEY to open them: set the key the api and scheduler "
                    "sealed them with on every process, then dispatch the item again"
                )
            try:
                return self.keyring.open(value, Purpose.ENV, org_id, item_id, field)
            except SecretKeyMismatchError as exc:
                if exc.code != SecretKeyMismatchError.code:
                    raise
                raise SecretKeyMismatchError(MISMATCH) from exc

        return _mapped(payload, opened)

    def seal_text(self, text: str, purpose: Purpose, *place: str) -> str:
        """``text`` sealed for ``purpose`` at ``place`` (a stored provider configuration,
        say).

        Raises:
            ConfigurationError: no secret key is configured.
        """
        return self._require().seal(text, purpose, *place)

    def open_text(self, text: str, purpose: Purpose, *place: str) -> str:
        """``text`` opened if it was sealed, else as it is.

        Raises:
            ConfigurationError: it is sealed and the key is missing or another one, or it
                was sealed for another purpose or place.
        """
        if not is_sealed(text):
            return text
        return self._require().open(text, purpose, *place)

    def _require(self) -> Keyring:
        if self.keyring is None:
            raise ConfigurationError(
                "CORRAL_SECRET_KEY is not set, so dispatch env values cannot be sealed or "
                "opened; generate one with `corral secret-key` and set it on every process"
            )
        return self.keyring
