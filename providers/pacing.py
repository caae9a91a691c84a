"""How fast corral may ask a provider for sandboxes: its pace limits.

Every provider's configuration carries three keys (:class:`corral.providers.config.ProviderConfig`):
``creates_per_s`` (a create rate; null: none), ``create_burst`` (how many creates may go at
once before the rate applies) and ``creates_in_flight`` (create calls outstanding at once;
null: no cap). A vendor's configuration sets their defaults from the vendor's documented
limits, through the field makers here, so that each default says where it comes from;
local, docker and kubernetes are not paced unless the deployment says so.

The pace is kept per provider credential and shared by every worker process
(:mod:`corral.shared.store.pacing`); this module holds only the limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field

# The default rates are this share of a vendor's documented rate: a create leaves corral
# some milliseconds before the vendor counts it, and that delay varies, so creates paced at
# the documented rate itself would sometimes arrive a little faster than it.
DOCUMENTED_SHARE = 0.9
# Where the vendors' defaults for creates in flight come from: no vendor documents one.
IN_FLIGHT_SOURCE = "not a vendor's figure: it bounds the calls outstanding while one slows down"


@dataclass(frozen=True)
class PaceLimits:
    """A provider's pace: a create rate with its burst, and a cap on creates in flight."""

    creates_per_s: float | None
    burst: int = 1
    in_flight: int | None = None

    @property
    def paced(self) -> bool:
        """Whether there is anything to pace (else a provision costs no pacing work)."""
        return self.creates_per_s is not None or self.in_flight is not None


def creates_per_s_field(default: float | None, source: str = "") -> Any:
    """The ``creates_per_s`` field, defaulting to ``default`` (``source``: where it comes from)."""
    return _field(
        default,
        source,
        "sandbox creates a second, per credential, across every worker (null: no rate); a "
        "rate-limit answer slows it, successes bring it back.",
        gt=0,
        le=10_000,
    )


def create_burst_field(default: int, source: str = "") -> Any:
    """The ``create_burst`` field, defaulting to ``default``."""
    description = "creates that may go at once before creates_per_s spaces them."
    return _field(default, source, description, ge=1, le=10_000)


def creates_in_flight_field(default: int | None, source: str = "") -> Any:
    """The ``creates_in_flight`` field, defaulting to ``default``."""
    description = (
        "create calls outstanding at once, per credential, across every worker (null: no cap)."
    )
    return _field(default, source, description, ge=1, le=100_000)


def _field(
    default: Any,
    source: str,
    description: str,
    *,
    le: float,
    gt: float | None = None,
    ge: float | None = None,
) -> Any:
    said = f" Default: {source}." if source else ""
    return Field(default=default, description=description + said, gt=gt, ge=ge, le=le)
