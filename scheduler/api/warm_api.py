"""The warm runner's calls (docs/warm-pools.md): enrol once, then wait on the channel.

``enrol`` trades a warm sandbox's single-use enrolment credential (``cre_``) for a channel
token (``crw_``); ``warm/wait`` (bearer: the channel token) is held up to
``CORRAL_WARM_WAIT_S`` and answers the bound item's registration token, minted then and sent
once, or null. Both answer one generic 401 for every bad or used credential, and for a warm
sandbox that ended; after the hand-over the channel is closed (401).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Annotated

from fastapi import APIRouter, Header
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select

from corral.scheduler.admin.responses import Enrolled, WarmWaitAnswer
from corral.scheduler.api.bodies import StrictJSONRoute
from corral.scheduler.api.process_runtime import ApiRuntime
from corral.scheduler.api.runner_api import UNAUTHORIZED, bearer
from corral.shared.runtime import Runtime
from corral.shared.store import warm
from corral.shared.store.db import Database
from corral.shared.store.models import WarmSandbox
from corral.shared.store.tokens import hash_token

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/runner", tags=["runner"], route_class=StrictJSONRoute)


class EnrolBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token: str = Field(max_length=200)
    runner_version: str | None = Field(default=None, max_length=64)


class WaitBody(BaseModel):
    model_config = ConfigDict(extra="forbid")


@router.post("/enrol")
def enrol(body: EnrolBody, rt: ApiRuntime) -> Enrolled:
    with rt.db.session() as session:
        channel = warm.enrol(session, body.token)
        if channel is None:
            raise UNAUTHORIZED
        warm_id = session.scalars(
            select(WarmSandbox.id).where(WarmSandbox.channel_hash == hash_token(channel))
        ).one()
    log.info("warm runner enrolled", extra={"sandbox_id": warm_id})
    return Enrolled(channel_token=channel, sandbox_id=warm_id, wait_s=rt.settings.warm_wait_s)


def _look(rt: Runtime, channel: str, seen: bool) -> warm.Handover:
    with rt.db.session() as session:
        return warm.hand_over(session, channel, token_ttl_s=rt.settings.token_ttl_s, seen=seen)


@router.post("/warm/wait")
async def wait(
    rt: ApiRuntime,
    body: WaitBody | None = None,
    authorization: Annotated[str | None, Header()] = None,
) -> WarmWaitAnswer:
    """Held until the warm sandbox is bound (the item's registration token, once) or
    ``CORRAL_WARM_WAIT_S`` passed (null)."""
    channel = bearer(authorization)
    if channel is None:
        raise UNAUTHORIZED
    give_up = time.monotonic() + rt.settings.warm_wait_s
    seen = True  # the first look notes that the runner is still there
    while True:
        answer = await run_in_threadpool(_look, rt, channel, seen)
        seen = False
        if answer.gone:
            raise UNAUTHORIZED
        left_s = give_up - time.monotonic()
        if answer.registration_token is not None or left_s <= 0:
            return WarmWaitAnswer(registration_token=answer.registration_token)
        await _BindWatch.of_loop().settled(rt, hash_token(channel), left_s)


class _BindWatch:
    """Every held wait of this api process (of its event loop), looked at together: one
    query each ``CORRAL_WARM_POLL_S`` for all of them, not one per wait — an idle warm
    sandbox costs the database nothing per look (:func:`corral.shared.store.warm.still_waiting`).
    A wait whose sandbox was bound or is gone is woken to take its answer."""

    def __init__(self) -> None:
        self._waits: dict[str, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None
        self._failing = False  # its last look failed (logged once until one succeeds)

    @classmethod
    def of_loop(cls) -> _BindWatch:
        loop = asyncio.get_running_loop()
        watch = _WATCHES.get(loop)
        if watch is None:
            watch = _WATCHES[loop] = cls()
        return watch

    async def settled(self, rt: Runtime, channel_hash: str, timeout_s: float) -> None:
        """Back when the channel's sandbox was bound or is gone, or after ``timeout_s``
        (the watch, when this wait starts it, looks in ``rt``'s database)."""
        woken = asyncio.Event()
        self._waits.setdefault(channel_hash, set()).add(woken)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._watch(rt))
        try:
            async with asyncio.timeout(timeout_s):
                await woken.wait()
        except TimeoutError:
            pass
        finally:
            events = self._waits.get(channel_hash, set())
            events.discard(woken)
            if not events:
                self._waits.pop(channel_hash, None)

    async def _watch(self, rt: Runtime) -> None:
        try:
            await self._poll(rt)
        finally:
            self._task = None  # the next wait starts another (and the loop is not kept)

    async def _poll(self, rt: Runtime) -> None:
        while self._waits:
            await asyncio.sleep(rt.settings.warm_poll_s)
            hashes = list(self._waits)
            if not hashes:
                break
            try:
                waiting = await run_in_threadpool(_still_waiting, rt.db, hashes)
            except Exception:  # the database: each wait looks once more when its time is up
                if not self._failing:
                    log.warning("warm waits: looking for bound sandboxes failed", exc_info=True)
                self._failing = True
                continue
            self._failing = False
            for channel_hash in set(hashes) - waiting:
                for woken in self._waits.get(channel_hash, ()):
                    woken.set()


_WATCHES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _BindWatch] = (
    weakref.WeakKeyDictionary()
)


def _still_waiting(db: Database, channel_hashes: list[str]) -> set[str]:
    with db.session() as session:
        return warm.still_waiting(session, channel_hashes)
