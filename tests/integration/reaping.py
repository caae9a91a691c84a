"""One reaper test's world: a runtime on a database of its own, a provider, the api, and a
Redis lock under a key prefix of its own."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import redis
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy import select, update

from corral.providers.base import SandboxProvider
from corral.scheduler.admin.pools import ProfileCreate, create_profile
from corral.scheduler.api.app import create_app
from corral.scheduler.intake import accept, route_item
from corral.shared import runtime
from corral.shared.broker import celery_app
from corral.shared.messages import DispatchRequest
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine, utcnow
from corral.shared.store.models import AuthMode, CostEvent, LifecycleEvent, Pool, Sandbox, WorkItem
from corral.worker.provision import Outcome, provision_item
from corral.worker.reaper import SweepReport, sweep
from corral.worker.sweep_lock import PostgresSweepLock

ADMIN = "reaper-admin-token"
RATE = 2_500  # micro-units per second (wall-clock), per session (fixed), per CPU second


@dataclass
class Reaped:
    """One test's world: a runtime on its own database, the fake provider, the api."""

    rt: Runtime
    provider: Any  # InMemoryProvider for most tests
    api: TestClient
    redis: redis.Redis
    prefix: str

    @property
    def db(self) -> Database:
        return self.rt.db

    def lock(self, lease_s: float = 30) -> PostgresSweepLock:
        return PostgresSweepLock(self.db.engine, lease_s=lease_s)

    def sweep(self) -> SweepReport:
        return sweep(self.rt, self.lock())

    def add_spare_pool(self) -> None:
        """A second pool of the provider for acme, "spare", after "main" (priority 10)."""
        with self.db.session() as session:
            session.execute(update(Pool).values(priority=10))
            session.add(
                Pool(
                    id="pool-spare",
                    org_id="acme",
                    name="spare",
                    provider_id=self.provider.id,
                    max_concurrent=50,
                    sandbox_config={},
                    billing_model="wall-clock",
                    rate_micros=RATE,
                )
            )

    def dispatch(self, **fields: Any) -> str:
        """Accept, route and provision one item; its sandbox waits for the runner."""
        request = DispatchRequest.model_validate(
            {
                "org": "acme",
                "project": "web",
                "profile": "default",
                "work": {"kind": "shell", "command": "echo hi"},
                **fields,
            }
        )
        item_id = accept(self.db, request, actor="test").item_id
        self.route_and_provision(item_id)
        return item_id

    def route_and_provision(self, item_id: str) -> None:
        assert (
            route_item(self.db, item_id, actor="test", settings=self.rt.settings).queue
            == f"provision.{self.provider.id}"
        )
        outcome = provision_item(self.rt, item_id, actor="test")
        assert outcome is Outcome.PROVISIONED, self.item(item_id).error_message

    def sandbox(self, item_id: str, attempt: int | None = None) -> Sandbox:
        with self.db.session() as session:
            query = select(Sandbox).where(Sandbox.work_item_id == item_id)
            if attempt is not None:
                query = query.where(Sandbox.attempt == attempt)
            return session.scalars(query.order_by(Sandbox.attempt.desc())).first()  # type: ignore[return-value]

    def item(self, item_id: str) -> WorkItem:
        with self.db.session() as session:
            found = session.get(WorkItem, item_id)
        assert found is not None
        return found

    def register(self, item_id: str) -> dict[str, str]:
        """The runner's side: redeem the token the provider got; the session's headers."""
        token = self.provider.boxes[self.sandbox(item_id).id].spec.registration_token
        answer = self.api.post("/v1/runner/register", json={"token": token.get_secret_value()})
        assert answer.status_code == 200, answer.text
        return {"Authorization": f"Bearer {answer.json()['session_token']}"}

    def claim(self, item_id: str) -> dict[str, str]:
        headers = self.register(item_id)
        assert self.api.post("/v1/runner/claim", headers=headers).status_code == 200
        return headers

    def backdate(self, sandbox_id: str, **columns_ago: float) -> None:
        """Move the named timestamps of a sandbox this many seconds into the past."""
        now = utcnow()
        values = {name: now - timedelta(seconds=ago) for name, ago in columns_ago.items()}
        with self.db.session() as session:
            session.execute(update(Sandbox).where(Sandbox.id == sandbox_id).values(**values))

    def costs(self, sandbox_id: str | None = None) -> list[CostEvent]:
        with self.db.session() as session:
            query = select(CostEvent).order_by(CostEvent.id)
            if sandbox_id is not None:
                query = query.where(CostEvent.sandbox_id == sandbox_id)
            return list(session.scalars(query))

    def terminate_calls(self) -> Counter[str]:
        return Counter(call.target for call in self.provider.calls if call.method == "terminate")

    def stale(self, count: int) -> list[str]:
        """``count`` dispatched items whose runners never claimed in time: their sandboxes'
        ids (rule never_claimed)."""
        sandboxes = []
        for _ in range(count):
            sandbox = self.sandbox(self.dispatch())
            self.backdate(sandbox.id, started_at=601)
            sandboxes.append(sandbox.id)
        return sandboxes

    def assert_ended_and_billed_once(self, sandbox_ids: list[str]) -> None:
        """Exactly these sandboxes have an ending in the lifecycle log and a cost event,
        one each."""
        with self.db.session() as session:
            endings = Counter(
                session.scalars(
                    select(LifecycleEvent.entity_id).where(
                        LifecycleEvent.entity == "sandbox",
                        LifecycleEvent.to_state.in_(["terminated", "failed"]),
                    )
                )
            )
            events = Counter(session.scalars(select(CostEvent.sandbox_id)))
        assert endings == Counter(sandbox_ids)
        assert events == Counter(sandbox_ids)


@contextmanager
def reaped_world(
    database_url: str,
    redis_url: str,
    state_dir: Path,
    provider: SandboxProvider,
    **settings: Any,
) -> Iterator[Reaped]:
    """The world around ``provider``: one pool of it (``pool-<id>``) for org acme."""
    core = CoreSettings(
        **{
            "state_dir": state_dir,
            "database_url": database_url,
            "broker_url": "memory://",
            "admin_token": SecretStr(ADMIN),
            "reconcile_interval_s": 0,
            "finish_grace_s": 5,
            "heartbeat_timeout_s": 60,
            "token_ttl_s": 600,
            "provision_timeout_s": 900,
            "max_attempts": 2,
            **settings,
        }
    )
    db = Database(make_engine(database_url))
    rt = Runtime(settings=core, db=db)
    rt.use_provider(provider)
    create_profile(db, ProfileCreate(name="default", model="m", auth_mode=AuthMode.BYOK))
    with db.session() as session:  # `create_pool` knows only registered providers
        session.add(
            Pool(
                id=f"pool-{provider.id}",
                org_id="acme",
                name="main",
                provider_id=provider.id,
                max_concurrent=50,
                sandbox_config={},
                billing_model="wall-clock",
                rate_micros=RATE,
            )
        )
    celery_app.configure(core)  # what the api sends stays in this process's memory broker
    runtime.install(rt)
    client = redis.Redis.from_url(redis_url)
    prefix = f"corral-test-{uuid.uuid4().hex[:10]}:"
    try:
        with TestClient(create_app()) as api:
            yield Reaped(rt, provider, api, client, prefix)
    finally:
        runtime.reset()
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()
        db.dispose()
