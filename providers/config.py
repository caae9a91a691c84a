"""Typed configuration for providers.

Each provider declares two pydantic models, both closed to unknown keys:

* a :class:`ProviderConfig` for the deployment (where the engine is, default image, limits),
  whose JSON schema is the provider's self-description (``corral providers schema NAME``);
* a :class:`ProviderOptions` for one sandbox (``SandboxSpec.provider_options``), validated
  before anything is allocated.

Secret fields are declared as ``pydantic.SecretStr``: their repr is masked, and
:meth:`ProviderConfig.redacted` (what we store or return) replaces their value with a mask.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from corral.providers.errors import InvalidProviderConfigError
from corral.providers.pacing import (
    PaceLimits,
    create_burst_field,
    creates_in_flight_field,
    creates_per_s_field,
)

# A key a message may name although the model lacks it: a typo of a field, not a value.
_FIELD_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def default_state_dir() -> Path:
    """Where corral keeps local state when ``CORRAL_STATE_DIR`` does not say."""
    return Path.home() / ".local" / "state" / "corral"


class ProviderConfig(BaseModel):
    """Deployment-wide configuration of one provider.

    Every provider's has the pace keys (:mod:`corral.providers.pacing`): none is paced
    unless its configuration (a vendor's defaults, or the deployment's) sets a rate or a cap.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    creates_per_s: float | None = creates_per_s_field(None)
    create_burst: int = create_burst_field(1)
    creates_in_flight: int | None = creates_in_flight_field(None)

    def pace(self) -> PaceLimits | None:
        """How fast sandboxes may be asked for; None: not paced."""
        limits = PaceLimits(self.creates_per_s, self.create_burst, self.creates_in_flight)
        return limits if limits.paced else None

    def redacted(self) -> dict[str, Any]:
        """A JSON-safe dict of this config with every secret masked."""
        return self.model_dump(mode="json")


class ProviderOptions(BaseModel):
    """Per-sandbox options a provider accepts on ``SandboxSpec.provider_options``."""

    model_config = ConfigDict(extra="forbid", frozen=True)


ModelT = TypeVar("ModelT", bound=BaseModel)


def parse_model(
    model: type[ModelT], data: Mapping[str, Any] | ModelT | None, *, what: str
) -> ModelT:
    """Validate ``data`` against ``model``, turning failures into one clear typed error.

    ``what`` names the thing being validated in the message, e.g. "options for provider local".

    Raises:
        InvalidProviderConfigError: naming each bad or unknown key and the keys allowed.
    """
    if isinstance(data, model):
        return data
    try:
        return model.model_validate(dict(data or {}))
    except ValidationError as exc:
        raise InvalidProviderConfigError(describe_validation_error(model, exc, what=what)) from exc


def describe_validation_error(model: type[BaseModel], exc: ValidationError, *, what: str) -> str:
    """A one-paragraph message for a validation error that names keys, not values.

    Values are left out on purpose: a rejected value may be a secret, and the message may go
    back to whoever sent it. A key the model does not have is named only when it looks like a
    field name (a typo), else shown as ``*``; a message that quotes the value is replaced.
    """
    unknown: list[str] = []
    invalid: list[str] = []
    for error in exc.errors(include_url=False):
        location = ".".join(_shown_key(part, model) for part in error["loc"]) or "(root)"
        if error["type"] == "extra_forbidden":
            unknown.append(location)
        else:
            invalid.append(f"{location}: {_unquoting_message(error)}")
    allowed = ", ".join(sorted(model.model_fields)) or "none"
    parts = []
    if unknown:
        parts.append(f"unknown key(s) {', '.join(repr(k) for k in unknown)}")
    if invalid:
        parts.append("invalid value(s): " + "; ".join(invalid))
    return f"invalid {what}: {'; '.join(parts)}. Allowed keys: {allowed}."


def _shown_key(part: object, model: type[BaseModel]) -> str:
    """A part of an error's location as a message may show it: a position, a field of
    ``model``, or a word shaped like a field name; anything else a client chose is ``*``."""
    text = str(part)
    if isinstance(part, int) or text in model.model_fields or _FIELD_NAME.fullmatch(text):
        return text
    return "*"


def _unquoting_message(error: Any) -> str:
    """pydantic's message, unless it quotes the refused value."""
    message = str(error["msg"])
    value = error.get("input")
    quoted = (repr(value), f"'{value}'", f'"{value}"') if isinstance(value, str) and value else ()
    if any(form in message for form in quoted):
        return f"invalid value ({error['type']})"
    return message
