"""Dispatch errors: why a work item could not be routed. Each code is recorded on the item."""

from __future__ import annotations

from datetime import datetime

from corral.shared.errors import CorralError
from corral.shared.store.expiry import EXPIRED


class DispatchError(CorralError):
    """The work item could not be dispatched."""

    code = "dispatch_error"


class InvalidMessageError(DispatchError, ValueError):
    """The dispatch message is malformed."""

    code = "invalid_message"


class UnknownProfileError(DispatchError, LookupError):
    """The dispatch message names a model profile that does not exist."""

    code = "unknown_profile"

    def __init__(self, message: str | None = None) -> None:
        # The message says which field, never the value the client sent.
        super().__init__(
            message
            or "the model profile the message names (field profile) "
            "does not exist; create it with `corral profiles create` or name "
            "an existing one"
        )


class AuthModeRequiresLocalError(DispatchError):
    """The profile's auth mode may only run on local pools, and none qualifies."""

    code = "auth_mode_requires_local"


class NoEligiblePoolError(DispatchError):
    """No active pool of the org satisfies the work item."""

    code = "no_eligible_pool"


class BudgetExhaustedError(DispatchError):
    """The org's budget, or that of every pool that could take the item, is spent."""

    code = "budget_exhausted"


class SecretKeyMissingError(DispatchError):
    """The message carries env values, and without a secret key they cannot be stored."""

    code = "secret_key_missing"

    def __init__(self) -> None:
        super().__init__(
            "the message carries env values, which corral keeps only sealed with "
            "CORRAL_SECRET_KEY, and none is set: generate one with `corral secret-key`, set it "
            "on every corral process, and send the message again (its env values were not kept)"
        )


class NetworkNotAllowedError(DispatchError):
    """The deployment gives the org's sandboxes no network."""

    code = "network_not_allowed"

    def __init__(self) -> None:
        super().__init__(
            "egress.allow_network: this deployment gives the org's sandboxes no network "
            "(CORRAL_SANDBOX_NETWORK, CORRAL_SANDBOX_NETWORK_EXCEPT_ORGS); send the item "
            "without network, or ask the operator"
        )


class ImageNotAllowedError(DispatchError):
    """The item names an image its org may not use."""

    code = "image_not_allowed"

    def __init__(self, reason: str) -> None:
        # The reference is not echoed: the answer says which field and what to do.
        super().__init__(
            f"image: {reason}; send the item without an image (its pool's runs), or ask the "
            "operator to allow it (`corral orgs policy set --item-images`, or "
            "CORRAL_ITEM_IMAGES for every org)"
        )


class RegionNotAllowedError(DispatchError):
    """The item asks for a region its org may not use."""

    code = "region_not_allowed"

    def __init__(self) -> None:
        super().__init__(
            "region: the deployment does not let this org's work ask for that region; send "
            "the item without a region or with one the org may use (`corral orgs policy "
            "show`), or ask the operator"
        )


class ExpiredError(DispatchError):
    """The message's own ``expires_at`` had passed when it arrived."""

    code = EXPIRED

    def __init__(self, expires_at: datetime) -> None:
        super().__init__(
            f"expires_at: the message's own expiry ({expires_at.isoformat()}) had passed when "
            "it arrived, so it was not run; send it again with a later expires_at, or none"
        )


class UnknownNamedSecretError(DispatchError, LookupError):
    """The message refers to a named secret that neither its org nor the deployment has."""

    code = "unknown_secret"

    def __init__(self, name: str, field: str) -> None:
        # A secret's name is not secret: it is named, so the sender knows which to set.
        super().__init__(
            f"{field}: no named secret {name} for the org or the deployment; set it with "
            "`corral secrets set` (or the admin api's secrets routes) and send the message "
            "again"
        )


DISPATCH_ERROR_CODES = {
    cls.code: cls
    for cls in (
        InvalidMessageError,
        UnknownProfileError,
        AuthModeRequiresLocalError,
        NoEligiblePoolError,
        BudgetExhaustedError,
        SecretKeyMissingError,
        NetworkNotAllowedError,
        ImageNotAllowedError,
        RegionNotAllowedError,
        ExpiredError,
        UnknownNamedSecretError,
    )
}
