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
from typing import Annotated

from fastapi import APIRouter, Header
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select

from corral.scheduler.answers import Enrolled, WarmWaitAnswer
from corral.scheduler.bodies import StrictJSONRoute
from corral.scheduler.runner_api import UNAUTHORIZED, bearer
from corral.shared import runtime, warm
from corral.shared.models import WarmSandbox
from corral.shared.tokens import hash_token

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/runner", tags=["runner"], route_class=StrictJSONRoute)


class EnrolBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    token: str = Field(max_length=200)
    runner_version: str | None = Field(default=None, max_length=64)


class WaitBody(BaseModel):
    model_config = ConfigDict(extra="forbid")


@router.post("/enrol")
def enrol(body: EnrolBody) -> Enrolled:
    rt = runtime.current()
    with rt.db.session() as session:
        channel = warm.enrol(session, body.token)
        if channel is None:
            raise UNAUTHORIZED
        warm_id = session.scalars(
            select(WarmSandbox.id).where(WarmSandbox.channel_hash == hash_token(channel))
        ).one()
    log.info("warm runner enrolled", extra={"sandbox_id": warm_id})
    return Enrolled(channel_token=channel, sandbox_id=warm_id, wait_s=rt.settings.warm_wait_s)


def _look(channel: str, seen: bool) -> warm.Handover:
    rt = runtime.current()
    with rt.db.session() as session:
        return warm.hand_over(session, channel, token_ttl_s=rt.settings.token_ttl_s, seen=seen)


@router.post("/warm/wait")
async def wait(
    body: WaitBody | None = None, authorization: Annotated[str | None, Header()] = None
) -> WarmWaitAnswer:
    """Held until the warm sandbox is bound (the item's registration token, once) or
    ``CORRAL_WARM_WAIT_S`` passed (null)."""
    channel = bearer(authorization)
    if channel is None:
        raise UNAUTHORIZED
    settings = runtime.current().settings
    give_up = time.monotonic() + settings.warm_wait_s
    seen = True  # the first look notes that the runner is still there
    while True:
        answer = await run_in_threadpool(_look, channel, seen)
        seen = False
        if answer.gone:
            raise UNAUTHORIZED
        if answer.registration_token is not None or time.monotonic() >= give_up:
            return WarmWaitAnswer(registration_token=answer.registration_token)
        await asyncio.sleep(settings.warm_poll_s)
