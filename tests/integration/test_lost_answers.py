"""A sandbox the provider made although its answer was lost never runs the work, on real
PostgreSQL and Redis through the provision, api and reaper paths.

The provider makes the sandbox and its answer is lost (a transient error), past the provision
task's retries, and the clean-up cannot reach it either: the item goes back to waiting (a
brown-out), not to ``failed``. The sandbox left behind holds a token that was revoked before
the item moved on, so its runner cannot register; the reaper's reconciliation ends it as an
orphan; the item's next attempt gets a sandbox of its own, whose runner alone runs the work.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from corral.providers.base import SandboxHandle, SandboxSpec
from corral.providers.errors import ProviderUnavailableError
from corral.providers.testing import InMemoryProvider
from corral.scheduler.intake import accept, route_item
from corral.shared.messages import DispatchRequest
from corral.shared.store.db import utcnow
from corral.shared.store.models import WorkItem
from corral.worker.provision import Outcome, provision_item
from tests.integration.reaping import Reaped, reaped_world


class AnswerLost(InMemoryProvider):
    """While ``losing``, makes each sandbox and then loses the answer (a transient error),
    and cannot be reached to terminate one either."""

    losing = False

    def provision(self, spec: SandboxSpec) -> SandboxHandle:
        handle = super().provision(spec)
        if self.losing:
            raise ProviderUnavailableError("the answer was lost on its way back")
        return handle

    def terminate(self, handle: SandboxHandle) -> None:
        if self.losing:
            raise ProviderUnavailableError("the provider cannot be reached")
        super().terminate(handle)


@pytest.fixture
def reaped(fresh_pg_url: str, redis_url: str, tmp_path: Path) -> Iterator[Reaped]:
    with reaped_world(fresh_pg_url, redis_url, tmp_path, AnswerLost()) as world:
        yield world


def test_a_sandbox_made_although_its_answer_was_lost_never_runs_the_work(reaped: Reaped) -> None:
    message = {"org": "acme", "project": "web", "profile": "default"}
    request = DispatchRequest.model_validate(message | {"work": {"kind": "shell", "command": "x"}})
    item_id = accept(reaped.db, request, actor="test").item_id
    provider = reaped.provider
    provider.losing = True
    routed = route_item(reaped.db, item_id, actor="test", settings=reaped.rt.settings)
    assert routed.queue == "provision.in-memory"
    # Its last try: the provision task's retries are spent.
    assert provision_item(reaped.rt, item_id, actor="test", final_attempt=True) is Outcome.WAITING

    assert (reaped.item(item_id).state, reaped.item(item_id).error_code) == (
        "received",
        "provider_unavailable",
    )
    left = reaped.sandbox(item_id, attempt=1)
    assert (left.status, left.termination_reason) == ("failed", "provision_unavailable")
    assert left.id in provider.boxes, "made at the provider, and the clean-up missed it"
    token = provider.boxes[left.id].spec.registration_token.get_secret_value()
    assert reaped.api.post("/v1/runner/register", json={"token": token}).status_code == 401

    provider.losing = False
    report = reaped.sweep()  # reconciliation: the provider holds a sandbox whose row ended
    assert left.id in report.orphans and left.id not in provider.boxes

    with reaped.db.session() as session:  # its back-off is over
        session.execute(update(WorkItem).values(not_before=utcnow() - timedelta(seconds=1)))
    reaped.route_and_provision(item_id)
    second = reaped.sandbox(item_id)
    assert second.attempt == 2 and list(provider.boxes) == [second.id]
    headers = reaped.claim(item_id)
    done = reaped.api.post("/v1/runner/complete", headers=headers, json={"exit_code": 0})
    assert done.json() == {"state": "succeeded"}
