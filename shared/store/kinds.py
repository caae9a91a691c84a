"""The store's enumerations, without SQLAlchemy: what a work item's state, a profile's auth
mode, a bundle's review and a cost grouping may be.

They are re-exported by :mod:`corral.shared.store.models` and
:mod:`corral.shared.store.ledger`, where the rows that hold them are; they live here so that
what reads them from the outside (the api's answer models, the client, the CLI) starts
without loading the database layer.
"""

from __future__ import annotations

import enum


class AuthMode(enum.StrEnum):
    LOCAL = "local"
    HOST_SESSION = "host-session"
    BYOK = "byok"
    METERED = "metered"
    SHARED = "shared"

    @property
    def pins_local(self) -> bool:
        """local and host-session credentials live on the host: only local pools may run them."""
        return self in (AuthMode.LOCAL, AuthMode.HOST_SESSION)


class ItemState(enum.StrEnum):
    RECEIVED = "received"
    WAITING_CAPACITY = "waiting_capacity"
    ROUTED = "routed"
    PROVISIONING = "provisioning"
    AWAITING_CLAIM = "awaiting_claim"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DISPATCH_ERROR = "dispatch_error"

    @property
    def is_final(self) -> bool:
        return self in FINAL_ITEM_STATES


FINAL_ITEM_STATES = frozenset(
    {ItemState.SUCCEEDED, ItemState.FAILED, ItemState.CANCELLED, ItemState.DISPATCH_ERROR}
)


class BundleReview(enum.StrEnum):
    """Where a result bundle's review stands (docs/dispatch.md#result-bundles-and-review)."""

    NOT_REQUIRED = "not_required"
    REVIEW_REQUESTED = "review_requested"
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    # An attempt's bundle whose item was requeued (its lease retries): not the item's result.
    DISCARDED = "discarded"


class CostGrouping(enum.StrEnum):
    POOL = "pool"
    PROVIDER = "provider"
    PROJECT = "project"
    ORG = "org"
