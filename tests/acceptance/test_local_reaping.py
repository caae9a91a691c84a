"""Local sandboxes leave no process behind (issue 13): fifty items through real processes
(api, scheduler, ``corral worker --provider local``, maintenance and beat), each sandbox ended
by the maintenance worker, another process than the one that started it. Afterwards the
provider worker has no zombie below it, no bubblewrap of this run is left, running or as a
zombie, and none was ever orphaned (handed to init, which may collect it late or never)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import pytest
from sqlalchemy import select

from corral.shared.store.db import Database
from corral.shared.store.models import Sandbox
from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack
from tests.processes import ProcessWatch, zombies_below

ITEMS = 50
T = TypeVar("T")


@pytest.fixture(scope="module")
def org(stack: Stack) -> str:
    """An org of this module's own with one local pool (the session's database is shared
    with other modules); the profile `default`, made here unless an earlier module made it."""
    return stack.make_org(f"reap-{uuid.uuid4().hex[:8]}")


def test_fifty_local_items_leave_no_zombie_and_no_orphaned_bubblewrap(
    stack: Stack, org: str, db: Database
) -> None:
    worker = stack.processes["worker-local"].pid
    with ProcessWatch(f"{stack.sandbox_root}/", worker) as watch:
        items = []
        for number in range(ITEMS):
            status, answer = stack.request("POST", "/v1/dispatch", shell(org, f"echo {number}"))
            assert status == 202, answer
            items.append(answer["id"])
        views = stack.wait_final(items, timeout_s=90)
        assert [v["state"] for v in views] == ["succeeded"] * ITEMS, views
        settled(
            "every sandbox of the run to be terminated",
            lambda: unterminated(db, items),
            timeout_s=30,
        )
        isolated = len(watch.seen)

        zombies = settled("no zombie below the provider worker", lambda: zombies_below(worker))
        orphans = settled("no bubblewrap of this run left", watch.left_behind)

    assert isolated >= ITEMS, "the sandboxes ran in bubblewrap: the run tested isolation"
    orphaned = list(watch.orphaned.values())
    assert (len(zombies), len(orphans), len(orphaned)) == (0, 0, 0), (
        f"{len(zombies)} zombies below the provider worker, e.g. {zombies[:2]}; "
        f"{len(orphans)} bubblewrap processes of this run left, e.g. {orphans[:2]}; "
        f"{len(orphaned)} handed to a process outside the worker's tree, e.g. {orphaned[:2]}"
    )


def unterminated(db: Database, items: list[str]) -> list[str]:
    with db.session() as session:
        rows = session.scalars(
            select(Sandbox.id).where(
                Sandbox.work_item_id.in_(items), Sandbox.terminated_at.is_(None)
            )
        ).all()
    return list(rows)


def settled(what: str, left: Callable[[], list[T]], *, timeout_s: float = 10) -> list[T]:
    """Wait until ``left()`` is empty; what is still left when ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = left()
        if not remaining or time.monotonic() > deadline:
            return remaining
        time.sleep(0.1)
