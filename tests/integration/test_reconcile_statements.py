"""A reconcile pass's statements do not grow with the live sandboxes: one read of the
pools' providers, one of the live set, one lookup of what the provider lists and the set
lacks, then the ends of what differs (a batch's few statements): as many for 1,000 live
sandboxes as for 10. Its time at 100,000 is bench.reaper's (docs/benchmarks.md)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.reaper import add_pool, counted, healthy_rows, insert_rows, spec_of
from corral.providers.base import SandboxHandle
from corral.providers.testing import InMemoryProvider
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store.db import Database, make_engine
from corral.worker.reaper import SweepReport, reconcile
from corral.worker.termination import end_sandboxes

World = tuple[Runtime, InMemoryProvider]


@pytest.fixture
def world(fresh_pg_url: str, tmp_path: Path) -> Iterator[World]:
    """A runtime on a database of its own, with the in-memory provider and its pool (the
    rows are bench.reaper's: the benchmark and this test see the same world)."""
    db = Database(make_engine(fresh_pg_url))
    settings = CoreSettings(state_dir=tmp_path, database_url=fresh_pg_url)
    rt = Runtime(settings=settings, db=db)
    provider = InMemoryProvider()
    rt.use_provider(provider)
    add_pool(db)
    yield rt, provider
    db.dispose()


def _live(world: World, numbers: range) -> list[str]:
    """Live sandboxes ``numbers`` in the database, each held by the provider: their ids."""
    rt, provider = world
    rows = healthy_rows(numbers)
    insert_rows(rt.db, rows)
    for _, sandbox in rows:
        provider.adopt(spec_of(sandbox))
    return [sandbox["id"] for _, sandbox in rows]


def _handle(sandbox_id: str) -> SandboxHandle:
    return SandboxHandle(provider_id="in-memory", external_id=sandbox_id, metadata={"org_id": "a"})


def _differences(world: World, first: int) -> dict[str, str]:
    """A live sandbox the provider lost, one that died there, and one only the provider
    holds (numbers ``first`` to ``first + 2``): what each should end as, by id."""
    _, provider = world
    gone, died = _live(world, range(first, first + 2))
    provider.vanish(_handle(gone))
    provider.finish(_handle(died), exit_code=137)
    [(_, unknown)] = healthy_rows(range(first + 2, first + 3))  # never written
    provider.adopt(spec_of(unknown))
    return {gone: "gone", died: "sandbox_lost", unknown["id"]: "orphan"}


@dataclass
class Pass:
    found: int  # statements of reconcile() itself
    statements: int  # with the ends of what it found
    ended: dict[str, str]  # by sandbox id, the reason


def _reconcile_pass(rt: Runtime) -> Pass:
    report = SweepReport()
    with counted(rt.db) as statements:
        stale = reconcile(rt, report)
        found = len(statements)
        endings = end_sandboxes(rt, stale, actor="reaper")
    assert report.errors == 0 and not endings.errors, (report, endings.errors)
    ended = {request.sandbox_id: request.reason.value for request in stale}
    ended.update(dict.fromkeys(report.orphans, "orphan"))
    return Pass(found, len(statements), ended)


def test_a_reconcile_pass_sends_as_many_statements_for_1000_live_sandboxes_as_for_10(
    world: World,
) -> None:
    passes = {}
    live = 0
    # The first pass fills what the process keeps between passes (its pools' providers).
    for size, first_difference in ((0, 100_000), (10, 100_010), (1_000, 100_020)):
        _live(world, range(live, size))
        live = size
        expected = _differences(world, first_difference)
        passes[size] = _reconcile_pass(world[0])
        assert passes[size].ended == expected
    # The providers of the pools, the live set, the lookup of the one unknown entry.
    assert passes[10].found == passes[1_000].found == 3
    assert passes[10].statements == passes[1_000].statements, passes
