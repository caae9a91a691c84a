"""The provider's own log of a sandbox that ends before its runner reported: read before it
is stopped, kept on its row, shown in its item's error; never waited on past the timeout."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from corral.providers.testing import InMemoryProvider
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store import secrets
from corral.shared.store.db import Database
from corral.shared.store.models import Sandbox, TerminationReason, WorkItem
from corral.worker.provision import Outcome, provision_item
from corral.worker.termination import EndRequest, end_sandboxes
from tests.seeding import in_memory_pool
from tests.unit.test_provision import routed_item

SECRET = "hunter2-horse-battery-staple"
TIMEOUT_S = 0.5


@pytest.fixture
def provider() -> Iterator[InMemoryProvider]:
    provider = InMemoryProvider({"hang_timeout_s": 30})
    yield provider
    provider.release_end_logs()  # a hung read of a test ends with it


@pytest.fixture
def rt(sqlite_db: Database, tmp_path: Path, provider: InMemoryProvider) -> Runtime:
    settings = CoreSettings(state_dir=tmp_path, max_attempts=2, end_log_timeout_s=TIMEOUT_S)
    runtime = Runtime(settings=settings, db=sqlite_db)
    runtime.use_provider(provider)
    in_memory_pool(sqlite_db)
    return runtime


def _last_attempt(rt: Runtime, provider: InMemoryProvider, *log: str) -> tuple[str, str]:
    """A provisioned item at its last attempt (of 2), whose sandbox printed ``log``, waiting
    for a runner that never comes: (item id, sandbox id)."""
    item_id = routed_item(rt, env={"PASSPHRASE": SECRET})
    assert provision_item(rt, item_id, actor="test") is Outcome.PROVISIONED
    with rt.db.session() as session:
        sandbox = session.scalars(select(Sandbox).where(Sandbox.work_item_id == item_id)).one()
        sandbox.attempt = 2
        session.get_one(WorkItem, item_id).attempts = 2
        sandbox_id = sandbox.id
    provider.boxes[sandbox_id].logs = list(log)
    return item_id, sandbox_id


def _rows(rt: Runtime, item_id: str, sandbox_id: str) -> tuple[WorkItem, Sandbox]:
    with rt.db.session() as session:
        return session.get_one(WorkItem, item_id), session.get_one(Sandbox, sandbox_id)


def test_a_never_claimed_sandbox_s_log_is_kept_and_ends_its_item_s_error(
    rt: Runtime, provider: InMemoryProvider
) -> None:
    item_id, sandbox_id = _last_attempt(
        rt,
        provider,
        "starting",
        f"\x1b[31mconnecting with {SECRET}\x1b[0m",
        "corral-entrypoint: /opt/tool is missing",
    )

    endings = end_sandboxes(
        rt, [EndRequest(sandbox_id, TerminationReason.NEVER_CLAIMED, "never claimed")], actor="r"
    )

    assert endings.ended[sandbox_id].failed == item_id
    item, sandbox = _rows(rt, item_id, sandbox_id)
    assert sandbox.end_log == (
        "starting\nconnecting with [redacted]\ncorral-entrypoint: /opt/tool is missing"
    )
    assert item.error_message == (
        "never claimed; gave up after 2 attempts; last lines: starting | connecting with "
        "[redacted] | corral-entrypoint: /opt/tool is missing"
    )
    assert provider.methods().index("end_log") < provider.methods().index("terminate")


def test_the_values_of_named_secrets_the_item_used_are_redacted_too(
    rt: Runtime, provider: InMemoryProvider
) -> None:
    named = "named-value-0815-of-acme"
    secrets.set_secret(rt.db, "acme", "db-password", named)
    item_id = routed_item(rt, secret_env={"DB_PASSWORD": "db-password"})
    assert provision_item(rt, item_id, actor="test") is Outcome.PROVISIONED
    with rt.db.session() as session:  # as the runner's claim reads it
        keyring = rt.db.sealer.keyring
        refs = {"DB_PASSWORD": "db-password"}
        secrets.resolve_for_item(session, keyring, (item_id, "acme"), refs, secrets.UsedIn.ENV)
        sandbox = session.scalars(select(Sandbox).where(Sandbox.work_item_id == item_id)).one()
        sandbox_id = sandbox.id
    provider.boxes[sandbox_id].logs = [f"password is {named}", "lost"]

    end_sandboxes(rt, [EndRequest(sandbox_id, TerminationReason.LOST, "lost")], actor="r")

    item, sandbox = _rows(rt, item_id, sandbox_id)
    assert sandbox.end_log == "password is [redacted]\nlost"
    assert named not in (item.error_message or "")


def test_a_finished_sandbox_s_log_is_not_read(rt: Runtime, provider: InMemoryProvider) -> None:
    item_id, sandbox_id = _last_attempt(rt, provider, "all went well")
    end_sandboxes(rt, [EndRequest(sandbox_id, TerminationReason.FINISHED)], actor="api")
    assert "end_log" not in provider.methods()
    assert _rows(rt, item_id, sandbox_id)[1].end_log is None


def test_a_provider_that_hangs_on_the_log_does_not_hold_up_the_end(
    rt: Runtime, provider: InMemoryProvider
) -> None:
    (first_item, first), (second_item, second) = (
        _last_attempt(rt, provider, "a line") for _ in range(2)
    )
    provider.hang_end_logs()

    started = time.monotonic()
    endings = end_sandboxes(
        rt,
        [
            EndRequest(first, TerminationReason.LOST, "the sandbox ended"),
            EndRequest(second, TerminationReason.NEVER_CLAIMED, "never claimed"),
        ],
        actor="reaper",
    )
    took = time.monotonic() - started

    # Both reads waited on together, for the timeout once: not once each, not for ever.
    assert TIMEOUT_S <= took < TIMEOUT_S + 2.0
    assert set(endings.ended) == {first, second} and endings.errors == {}
    for item_id, sandbox_id, detail in (
        (first_item, first, "the sandbox ended"),
        (second_item, second, "never claimed"),
    ):
        item, sandbox = _rows(rt, item_id, sandbox_id)
        assert (item.state, sandbox.end_log) == ("failed", None)
        assert item.error_message == f"{detail}; gave up after 2 attempts"


def test_a_provider_that_fails_on_the_log_leaves_the_end_without_it(
    rt: Runtime, provider: InMemoryProvider
) -> None:
    provider.config = provider.config.model_copy(update={"hang_timeout_s": 0.01})
    provider.hang_end_logs()  # the read times out at the provider, and raises
    item_id, sandbox_id = _last_attempt(rt, provider, "a line")

    endings = end_sandboxes(
        rt, [EndRequest(sandbox_id, TerminationReason.NEVER_CLAIMED, "never claimed")], actor="r"
    )

    assert endings.ended[sandbox_id].failed == item_id and endings.errors == {}
    assert _rows(rt, item_id, sandbox_id)[1].end_log is None
    assert "end_log" in provider.methods()
