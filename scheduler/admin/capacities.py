"""Shared capacities and org weights: what the deployment admin sets, through the CLI, the
admin api or the console. The division itself is :mod:`corral.shared.store.shares`; a pool
is put on a capacity by its ``capacity`` setting (:mod:`corral.scheduler.admin.pools`)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from corral.scheduler.admin.pools import AdminError, redrive_soon
from corral.shared.store import shares
from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import Capacity, Pool
from corral.shared.text import IDENTIFIER


class CapacityError(AdminError):
    """The capacity request is invalid."""

    code = "invalid_capacity"


class CapacityNotFoundError(CapacityError, LookupError):
    """No such capacity."""

    code = "capacity_not_found"


class CapacityNameTakenError(CapacityError):
    """Another capacity has that name."""

    code = "capacity_name_taken"


class CapacityInUseError(CapacityError):
    """Pools draw on the capacity."""

    code = "capacity_in_use"


Slots = Annotated[
    int,
    Field(ge=1, le=shares.MAX_SLOTS, description="sandboxes at once across every pool on it"),
]


class CapacityUpdate(BaseModel):
    """What changes of a capacity: its slots."""

    model_config = ConfigDict(extra="forbid")

    slots: Slots


class CapacityCreate(CapacityUpdate):
    """A new shared capacity: its name and how many slots it shares."""

    name: str = Field(pattern=IDENTIFIER, description="unique in the deployment")


class WeightSet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight: int = Field(
        ge=1,
        le=shares.MAX_WEIGHT,
        description=f"the org's weight in the division (default {shares.DEFAULT_WEIGHT})",
    )


def create_capacity(db: Database, request: CapacityCreate) -> dict[str, Any]:
    """Create a capacity; pools are put on it by their ``capacity`` setting.

    Raises:
        CapacityNameTakenError: another capacity has that name.
    """
    try:
        with db.session() as session:
            capacity = Capacity(
                id=f"cap-{uuid.uuid4().hex[:16]}", name=request.name, slots=request.slots
            )
            session.add(capacity)
            session.flush()
            return capacity_document(session, capacity)
    except IntegrityError as exc:
        raise CapacityNameTakenError(
            "name: another capacity has that name; `corral capacities list` lists them"
        ) from exc


def list_capacities(db: Database) -> list[dict[str, Any]]:
    """Every capacity, by name, with the pools that draw on it."""
    with db.session() as session:
        found = session.scalars(select(Capacity).order_by(Capacity.name))
        return [capacity_document(session, capacity) for capacity in found]


def find_capacity(db: Database, name_or_id: str) -> dict[str, Any]:
    """The capacity of that name (or id), with the pools that draw on it.

    Raises:
        CapacityNotFoundError: none.
    """
    with db.session() as session:
        return capacity_document(session, _capacity(session, name_or_id))


def update_capacity(db: Database, name_or_id: str, change: CapacityUpdate) -> dict[str, Any]:
    """Change a capacity's slots; the re-drive divides them again (asked for at once).
    Fewer slots than its pools hold take none from them: no new item starts on it until
    they are under the new number.

    Raises:
        CapacityNotFoundError: no such capacity.
    """
    with db.session() as session:
        capacity = _capacity(session, name_or_id)
        capacity.slots = change.slots
        capacity.updated_at = utcnow()
        session.flush()
        document = capacity_document(session, capacity)
    redrive_soon()
    return document


def delete_capacity(db: Database, name_or_id: str) -> None:
    """Delete a capacity no pool draws on.

    Raises:
        CapacityNotFoundError: no such capacity.
        CapacityInUseError: naming the pools on it, to take off it first.
    """
    with db.session() as session:
        capacity = _capacity(session, name_or_id)
        linked = session.execute(
            select(Pool.org_id, Pool.name)
            .where(Pool.capacity_id == capacity.id, Pool.deleted_at.is_(None))
            .order_by(Pool.org_id, Pool.name)
        ).all()
        if linked:
            pools = ", ".join(f"{org}/{name}" for org, name in linked)
            raise CapacityInUseError(
                f"pools draw on the capacity: {pools}; take each off it first (`corral pools "
                "update NAME --org ORG --no-capacity`, or capacity null), then delete it"
            )
        # Pools deleted before a pool's deletion unlinked it still name it.
        shares.take_all_off(session, capacity.id)
        session.delete(capacity)


def capacity_names(db: Database) -> list[str]:
    """Every capacity's name, in order (what a pool form offers)."""
    with db.session() as session:
        return list(session.scalars(select(Capacity.name).order_by(Capacity.name)))


def _capacity(session: Session, name_or_id: str) -> Capacity:
    """The capacity of that name or id, its row locked.

    Raises:
        CapacityNotFoundError: none.
    """
    capacity = session.scalars(
        select(Capacity)
        .where((Capacity.name == name_or_id) | (Capacity.id == name_or_id))
        .with_for_update()
    ).first()
    if capacity is None:
        raise CapacityNotFoundError("no such capacity; `corral capacities list` lists them")
    return capacity


def capacity_document(session: Session, capacity: Capacity) -> dict[str, Any]:
    """A capacity and its members: each pool on it with its org's weight, the slots it holds,
    its share and its items waiting for it."""
    pools = session.scalars(
        select(Pool)
        .where(Pool.capacity_id == capacity.id, Pool.deleted_at.is_(None))
        .order_by(Pool.org_id, Pool.name)
    ).all()
    weights = shares.weights_of(session, [pool.org_id for pool in pools])
    members = []
    for pool in pools:
        waiting, counted_all = shares.waiting_for(
            session, pool.org_id, pool.id, shares.WAITING_COUNTED
        )
        members.append(
            {
                "pool_id": pool.id,
                "pool": pool.name,
                "org_id": pool.org_id,
                "active": pool.active,
                "weight": weights.get(pool.org_id, shares.DEFAULT_WEIGHT),
                "slots_in_use": pool.slots_in_use,
                "share_limit": pool.share_limit,
                "waiting": waiting,
                "waiting_counted_all": counted_all,
            }
        )
    return {
        "id": capacity.id,
        "name": capacity.name,
        "slots": capacity.slots,
        "slots_in_use": sum(pool.slots_in_use for pool in pools),
        "created_at": capacity.created_at,
        "updated_at": capacity.updated_at,
        "pools": members,
    }


def org_weight(db: Database, org_id: str) -> dict[str, Any]:
    """The org's weight in the division of shared capacity, and whether it is the default."""
    with db.session() as session:
        stored = shares.weights_of(session, [org_id]).get(org_id)
    return {
        "org_id": org_id,
        "weight": shares.DEFAULT_WEIGHT if stored is None else stored,
        "default": stored is None,
    }


def set_org_weight(db: Database, org_id: str, weight: int | None) -> dict[str, Any]:
    """Set the org's weight (None: back to the default); the re-drive divides by it from
    its next run (asked for at once).

    Raises:
        AdminError: a weight outside 1..MAX_WEIGHT.
    """
    try:
        with db.session() as session:
            shares.set_weight(session, org_id, weight)
    except ValueError as exc:
        raise AdminError(f"weight: {exc}") from exc
    redrive_soon()
    return org_weight(db, org_id)
