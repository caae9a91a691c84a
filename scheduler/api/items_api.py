"""The api for callers of work items: list and search an org's items, and wait for one to
end (docs/dispatch.md: learning an outcome).

``GET /v1/work-items`` lists the caller's org's items, newest first, filtered by project,
state, idempotency key, the Celery task id of the message that made it, creation time,
provider or pool, a page at a time (an opaque cursor
names where the next page starts). ``GET /v1/work-items/{id}?wait=S`` answers once the item
is final or S seconds have passed, whichever comes first: a caller polls once per item, not
once a second. A process holds at most :data:`MAX_WAITERS` waits at once, and at most
:data:`MAX_WAITERS_PER_ORG` of one org's (or the deployment admin's), so that no tenant's
waits crowd out another's; past either a wait answers at once, as without ``wait`` (the
state says whether the item is final).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Query

from corral.scheduler.admin import views
from corral.scheduler.admin.responses import WorkItemList
from corral.scheduler.api.auth import Principal, Scope, needs
from corral.scheduler.api.http_errors import InvalidRequest
from corral.scheduler.api.process_runtime import ApiRuntime
from corral.shared.runtime import Runtime
from corral.shared.store.models import FINAL_ITEM_STATES, ItemState
from corral.shared.text import IDENTIFIER, Printable

MAX_WAIT_S = 60.0
MAX_WAITERS = 256  # waits one process holds at once
MAX_WAITERS_PER_ORG = 32  # of them, one org's
MAX_PAGE = 200
_FINAL = {state.value for state in FINAL_ITEM_STATES}


class Waits:
    """The waits one process holds, counted in all and per org (an event loop's: no lock)."""

    def __init__(self, total: int = MAX_WAITERS, per_org: int = MAX_WAITERS_PER_ORG) -> None:
        self.total, self.per_org = total, per_org
        self.held: dict[str | None, int] = {}

    def take(self, org_id: str | None) -> bool:
        """Hold one more wait of ``org_id`` (None: the deployment admin's), if both caps allow."""
        mine = self.held.get(org_id, 0)
        if mine >= self.per_org or sum(self.held.values()) >= self.total:
            return False
        self.held[org_id] = mine + 1
        return True

    def give(self, org_id: str | None) -> None:
        left = self.held[org_id] - 1
        if left:
            self.held[org_id] = left
        else:
            del self.held[org_id]


_waits = Waits()

router = APIRouter()
Lister = Annotated[Principal, Depends(needs(Scope.READ))]
Name = Annotated[str | None, Query(pattern=IDENTIFIER)]


def encode_cursor(created_at: str, item_id: str) -> str:
    """Where the page after an item starts: its creation time and id, opaque to callers."""
    return base64.urlsafe_b64encode(f"{created_at}|{item_id}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """Raises: InvalidRequest: not a cursor this api gave out."""
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        created_at, item_id = text.split("|", 1)
        return datetime.fromisoformat(created_at), item_id
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise InvalidRequest(
            "query.cursor", "not a cursor of this api: pass next_cursor as it came"
        ) from None


@router.get("/v1/work-items")
def list_work_items(
    caller: Lister,
    rt: ApiRuntime,
    *,
    org: Name = None,
    project: Name = None,
    state: Annotated[list[ItemState] | None, Query()] = None,
    idempotency_key: Annotated[Printable | None, Query(min_length=1, max_length=255)] = None,
    task_id: Annotated[Printable | None, Query(min_length=1, max_length=255)] = None,
    created_after: datetime | None = None,
    created_before: datetime | None = None,
    provider: Name = None,
    pool: Name = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> WorkItemList:
    """The org's work items, newest first; an org key sees its own org's alone."""
    where = views.ItemFilter(
        org_id=caller.org_filter(org),
        states=state,
        since=created_after,
        until=created_before,
        project=project,
        idempotency_key=idempotency_key,
        task_id=task_id,
        pool_id=pool,
        provider=provider,
    )
    after = decode_cursor(cursor) if cursor is not None else None
    rows = views.list_items(rt.db, limit=limit + 1, before=after, where=where)
    page, more = rows[:limit], len(rows) > limit
    last = page[-1] if page else None
    next_cursor = encode_cursor(last["created_at"], last["id"]) if more and last else None
    return WorkItemList.model_validate({"items": page, "next_cursor": next_cursor})


async def wait_until_final(
    rt: Runtime, item_id: str, wait_s: float, *, org_id: str | None, waits: Waits = _waits
) -> None:
    """Return once ``item_id`` is final, or ``wait_s`` has passed (or at once when the
    process holds as many waits as ``waits`` allows, in all or of ``org_id``)."""
    if wait_s <= 0 or not waits.take(org_id):
        return
    deadline = time.monotonic() + wait_s
    pause = 0.05
    try:
        while True:
            found = await asyncio.to_thread(views.item_state, rt.db, item_id)
            left = deadline - time.monotonic()
            if found is None or found[0] in _FINAL or left <= 0:
                return
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, 0.5)
    finally:
        waits.give(org_id)
