"""The api's probes: ``/livez`` (the process serves requests) and ``/readyz`` (it can do
its work: the database and the broker answer).

A liveness probe that read the database would restart every api pod on a database blip;
restarting cures nothing there. Readiness takes a pod out of its Service instead, until
both answer again. ``/healthz`` is the readiness check under its older name.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from sqlalchemy import text

from corral.scheduler.admin.responses import Answer, Health
from corral.scheduler.api.process_runtime import ApiRuntime
from corral.shared.broker import celery_app
from corral.shared.store.db import Database

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0
Check = Literal["ok", "unreachable"]


class Readiness(Answer):
    status: Literal["ok", "unavailable"]
    database: Check
    broker: Check


def install(api: FastAPI) -> None:
    api.get("/livez")(livez)
    unready: dict[int | str, dict[str, Any]] = {
        503: {"model": Readiness, "description": "The database or the broker is down."}
    }
    api.get("/readyz", response_model=Readiness, responses=unready)(readyz)
    api.get("/healthz", response_model=Readiness, responses=unready)(readyz)


def livez() -> Health:
    return Health(status="ok")


def readyz(rt: ApiRuntime) -> Readiness | JSONResponse:
    checks: dict[str, Check] = {
        "database": "ok" if _database_answers(rt.db) else "unreachable",
        "broker": "ok" if _broker_answers() else "unreachable",
    }
    if all(check == "ok" for check in checks.values()):
        return Readiness(status="ok", **checks)
    answer = Readiness(status="unavailable", **checks)
    return JSONResponse(answer.model_dump(), status_code=503, headers={"Retry-After": "5"})


def _database_answers(db: Database) -> bool:
    try:
        with db.session() as session:
            session.execute(text("select 1"))
    except Exception as exc:  # any failure is "not ready", said without the URL
        log.warning("readiness: the database does not answer (%s)", type(exc).__name__)
        return False
    return True


def _broker_answers() -> bool:
    try:
        with celery_app.app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, interval_start=0, timeout=PROBE_TIMEOUT_S)
    except Exception as exc:
        log.warning("readiness: the broker does not answer (%s)", type(exc).__name__)
        return False
    return True
