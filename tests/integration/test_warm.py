"""Warm sandboxes' database side on real PostgreSQL (docs/warm-pools.md): credentials are
single use, a warm sandbox is bound to one item however many binders race for it, the hand-
over happens once, and beat's tick fills, trims and ends what it should."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, insert, select, update

from bench.reaper import healthy_rows, insert_rows
from corral.providers.base import SandboxHandle
from corral.providers.testing import InMemoryProvider
from corral.scheduler.admin.pools import ProfileCreate, create_profile
from corral.scheduler.api.console import queries
from corral.scheduler.batch import accept_batch
from corral.shared.messages import DispatchRequest
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings
from corral.shared.store import warm
from corral.shared.store.budgets import spend
from corral.shared.store.db import Database, make_engine, utcnow
from corral.shared.store.ledger import CostGrouping, cost_report
from corral.shared.store.models import AuthMode, Budget, Pool, Sandbox, WarmSandbox, WorkItem
from corral.shared.store.tokens import redeem_registration_token
from corral.worker.claims import ClaimRequest, claim_routed
from corral.worker.provision import Outcome, provision_item
from corral.worker.reaper import SweepReport, _recorded_live, reconcile
from corral.worker.warm import provision_warm, warm_tick
from tests.seeding import SETTINGS, enrolled_warm_sandboxes

POOL = "pool-warm"


@pytest.fixture
def db(fresh_pg_url: str) -> Iterator[Database]:
    database = Database(make_engine(fresh_pg_url, settings=CoreSettings(db_pool_size=12)))
    create_profile(database, ProfileCreate(name="default", model="m", auth_mode=AuthMode.BYOK))
    with database.session() as session:
        session.add(
            Pool(
                id=POOL,
                org_id="acme",
                name="warm",
                provider_id="in-memory",
                max_concurrent=100,
                sandbox_config={},
                warm_min=2,
                rate_micros=1000,
                capabilities={"idle_cost_model": "metered"},
            )
        )
    yield database
    database.dispose()


def made(db: Database, count: int) -> list[tuple[str, str]]:
    """``count`` warm sandboxes of the pool, made 30 s ago and enrolled: (warm id, channel)."""
    return enrolled_warm_sandboxes(
        db,
        count,
        pool_id=POOL,
        org_id="acme",
        provider_id="in-memory",
        created_at=utcnow() - timedelta(seconds=30),
    )


def bind_to(db: Database, item_id: str, sandbox_id: str) -> warm.Bound | None:
    """Bind an item of the pool to a waiting warm sandbox whose runner called within 60 s."""
    return warm.bind(db, POOL, item_id, sandbox_id, revoke_hash="0" * 64, seen_within_s=60)


def rows(db: Database) -> dict[str, WarmSandbox]:
    with db.session() as session:
        found = {row.id: row for row in session.scalars(select(WarmSandbox))}
        session.expunge_all()
    return found


def test_an_enrolment_credential_opens_one_channel_once(db: Database) -> None:
    warm_id = warm.new_warm_id()
    with db.session() as session:
        session.add(
            WarmSandbox(
                id=warm_id, pool_id=POOL, org_id="acme", provider_id="in-memory", state="booting"
            )
        )
    taken = warm.take_for_provision(db, warm_id)
    assert taken is not None
    assert warm.take_for_provision(db, warm_id) is None, "a second delivery mints nothing"
    credential = taken[2]
    assert credential.startswith("cre_")
    with db.session() as session:
        channel = warm.enrol(session, credential)
        assert channel is not None and channel.startswith("crw_")
        assert warm.enrol(session, credential) is None, "single use"
        assert warm.enrol(session, "cre_unknown") is None
        assert warm.enrol(session, channel) is None
    row = rows(db)[warm_id]
    assert row.state == "booting", "enrolled, but its handle is not recorded yet"
    assert warm.record_made(db, warm_id, SandboxHandle(provider_id="in-memory", external_id="x"))
    row = rows(db)[warm_id]
    assert row.state == "waiting" and row.ready_at is not None
    assert credential not in str(vars(row)) and channel not in str(vars(row)), "hashes only"


def test_two_binders_per_warm_sandbox_at_once_bind_each_once(db: Database) -> None:
    sandboxes = made(db, 4)
    binders = 8
    barrier = threading.Barrier(binders)

    def bind(number: int) -> warm.Bound | None:
        barrier.wait(5)
        return warm.bind(
            db, POOL, f"wi-{number}", f"sb-{number}-1", revoke_hash="0" * 64, seen_within_s=60
        )

    with ThreadPoolExecutor(binders) as pool:
        results = list(pool.map(bind, range(binders)))
    bound = [result for result in results if result is not None]
    assert sorted(result.warm_id for result in bound) == sorted(i for i, _ in sandboxes)
    after = rows(db)
    assert {row.state for row in after.values()} == {"bound"}
    items = [row.work_item_id for row in after.values()]
    assert len(set(items)) == 4, "no item was given two warm sandboxes"
    assert all((row.idle_amount_micros or 0) >= 30_000 for row in after.values()), "billed"
    assert bind_to(db, "wi-late", "sb-late-1") is None


def test_the_hand_over_mints_the_items_token_once(db: Database) -> None:
    [(warm_id, channel)] = made(db, 1)
    [item_id] = _routed(db, 1)
    with db.session() as session:
        session.add(
            Sandbox(
                id="sb-x-1",
                work_item_id=item_id,
                attempt=1,
                org_id="acme",
                pool_id=POOL,
                provider_id="in-memory",
                status="provisioning",
            )
        )
        assert warm.hand_over(session, channel, token_ttl_s=60) == warm.Handover(), "not bound"
    assert bind_to(db, item_id, "sb-x-1") is not None
    with db.session() as session:
        given = warm.hand_over(session, channel, token_ttl_s=60)
    token = given.registration_token
    assert token is not None and token.startswith("crt_")
    with db.session() as session:
        assert warm.hand_over(session, channel, token_ttl_s=60).gone, "the channel closed"
        redeemed = redeem_registration_token(session, token)
        assert redeemed is not None and redeemed.sandbox_id == "sb-x-1"
        assert redeem_registration_token(session, token) is None, "single use"
    assert rows(db)[warm_id].handed_over_at is not None


def test_the_tick_fills_to_warm_min_trims_the_surplus_and_ends_the_idle(db: Database) -> None:
    first = warm.tick(db, boot_timeout_s=300, seen_within_s=60)
    assert len(first.made) == 2 and {queue for _, queue in first.made} == {"provision.in-memory"}
    assert warm.tick(db, boot_timeout_s=300, seen_within_s=60).made == [], "booting ones count"
    stuck = warm.tick(db, boot_timeout_s=0, seen_within_s=60)
    assert sorted(e.reason for e in stuck.ended) == ["provision_stuck"] * 2
    assert len(stuck.made) == 2, "and are replaced"
    for warm_id, _ in stuck.made:
        taken = warm.take_for_provision(db, warm_id)
        assert taken is not None
        assert warm.record_made(
            db, warm_id, SandboxHandle(provider_id="in-memory", external_id=warm_id)
        )
        with db.session() as session:
            assert warm.enrol(session, taken[2]) is not None
    with db.session() as session:
        session.execute(update(Pool).where(Pool.id == POOL).values(warm_min=1))
    trimmed = warm.tick(db, boot_timeout_s=300, seen_within_s=60)
    assert [e.reason for e in trimmed.ended] == ["surplus"] and trimmed.made == []
    with db.session() as session:
        session.execute(
            update(WarmSandbox)
            .where(WarmSandbox.state == "waiting")
            .values(ready_at=utcnow() - timedelta(seconds=601))
        )
    idle = warm.tick(db, boot_timeout_s=300, seen_within_s=60)
    assert [e.reason for e in idle.ended] == ["idle_ttl"] and len(idle.made) == 1
    ended = [row for row in rows(db).values() if row.end_reason == "idle_ttl"]
    assert ended[0].state == "ended" and ended[0].idle_amount_micros is not None


Worker = tuple[Runtime, InMemoryProvider]


@pytest.fixture
def worker(db: Database, tmp_path: Path) -> Worker:
    """A provider worker's runtime on the database, with the in-memory provider."""
    rt = Runtime(settings=CoreSettings(state_dir=tmp_path), db=db)
    provider = InMemoryProvider()
    rt.use_provider(provider)
    return rt, provider


def made_by_the_worker(worker: Worker) -> list[str]:
    """The pool's warm sandboxes, as beat's tick and the worker make them, their runners
    enrolled (with the credential the provider got in the spec): their ids."""
    rt, provider = worker
    ticked = warm_tick(rt)
    assert [provision_warm(rt, warm_id) for warm_id, _ in ticked.made] == ["made", "made"]
    for warm_id, _ in ticked.made:
        with rt.db.session() as session:
            credential = provider.boxes[warm_id].spec.registration_token.get_secret_value()
            assert warm.enrol(session, credential) is not None
    return [warm_id for warm_id, _ in ticked.made]


def _routed(db: Database, count: int, **fields: object) -> list[str]:
    requests = [
        DispatchRequest.model_validate(
            {
                "org": "acme",
                "project": "web",
                "profile": "default",
                "work": {"kind": "shell", "command": f"echo {number}"},
                **fields,
            }
        )
        for number in range(count)
    ]
    return [taken.item_id for taken in accept_batch(db, requests, actor="test", settings=SETTINGS)]


def test_a_provision_binds_a_waiting_warm_sandbox_and_makes_none(
    db: Database, worker: Worker
) -> None:
    rt, provider = worker
    [(warm_id, _)] = made(db, 1)
    item_id, cold_id = _routed(db, 2)
    [networked] = _routed(db, 1, egress={"allow_network": True})
    assert provision_item(rt, item_id, actor="test") is Outcome.WARM
    assert "provision" not in provider.methods(), "no sandbox was made for it"
    assert provision_item(rt, networked, actor="test") is Outcome.PROVISIONED, "not warm-fit"
    assert provision_item(rt, cold_id, actor="test") is Outcome.PROVISIONED, "none left"
    with db.session() as session:
        item = session.get(WorkItem, item_id)
        [sandbox] = session.scalars(select(Sandbox).where(Sandbox.work_item_id == item_id))
        assert item is not None and item.state == "awaiting_claim"
        assert sandbox.external_id == warm_id and sandbox.status == "ready"
    assert rows(db)[warm_id].work_item_id == item_id


def test_reconciliation_knows_warm_sandboxes_bound_or_not(db: Database, worker: Worker) -> None:
    rt, provider = worker
    made_ids = made_by_the_worker(worker)
    [item_id] = _routed(db, 1)
    assert provision_item(rt, item_id, actor="test") is Outcome.WARM

    report = SweepReport()
    assert reconcile(rt, report) == [] and report.orphans == [], "both are known"
    with db.session() as session:  # the instant between the bind and its handle's record
        session.execute(
            update(Sandbox).where(Sandbox.work_item_id == item_id).values(external_id=None)
        )
    assert reconcile(rt, report) == [] and report.orphans == []
    with db.session() as session:  # its item's sandbox ended, but the provider still has it
        session.execute(
            update(Sandbox).where(Sandbox.work_item_id == item_id).values(terminated_at=utcnow())
        )
    reconcile(rt, report)
    bound = [row.id for row in rows(db).values() if row.state == "bound"]
    assert report.orphans == bound, "then it is an orphan"
    assert set(provider.boxes) == set(made_ids) - set(bound), "the other waits"


def test_a_warm_sandbox_whose_runner_stopped_calling_is_not_bound_and_is_ended(
    db: Database,
) -> None:
    [(silent, _), (calling, channel)] = made(db, 2)
    with db.session() as session:
        session.execute(
            update(WarmSandbox)
            .where(WarmSandbox.id.in_([silent, calling]))
            .values(last_seen_at=utcnow() - timedelta(seconds=120))
        )
        # A wait call's first look notes the runner; its later looks do not.
        assert warm.hand_over(session, channel, token_ttl_s=60, seen=True) == warm.Handover()
    bound = bind_to(db, "wi-1", "sb-1-1")
    assert bound is not None and bound.warm_id == calling, "the silent one is passed by"
    ticked = warm.tick(db, boot_timeout_s=300, seen_within_s=60)
    assert [(e.warm_id, e.reason) for e in ticked.ended] == [(silent, "runner_lost")]


def test_a_warm_sandbox_bound_by_a_worker_that_died_is_ended_by_the_takeover(
    db: Database, worker: Worker
) -> None:
    rt, provider = worker
    made_by_the_worker(worker)
    [item_id] = _routed(db, 1)
    # A worker claims the item under a lease that has run out, binds a warm sandbox, and dies
    # before it records the handle.
    [fresh] = claim_routed(db, [ClaimRequest(item_id, "dead")], lease_s=-1, token_ttl_s=60)
    assert fresh is not None
    first = bind_to(db, item_id, fresh.sandbox_id)
    assert first is not None

    assert provision_item(rt, item_id, actor="test") is Outcome.WARM  # the takeover
    after = rows(db)
    assert (after[first.warm_id].state, after[first.warm_id].end_reason) == ("ended", "superseded")
    assert first.warm_id not in provider.boxes, "terminated at its provider"
    [second] = [row for row in after.values() if row.state == "bound"]
    with db.session() as session:
        [sandbox] = session.scalars(select(Sandbox).where(Sandbox.work_item_id == item_id))
    assert sandbox.external_id == second.id != first.warm_id


def test_two_ticks_at_once_fill_the_gap_once(db: Database) -> None:
    barrier = threading.Barrier(4)

    def run(_: int) -> warm.Tick:
        barrier.wait(5)
        return warm.tick(db, boot_timeout_s=300, seen_within_s=60)

    with ThreadPoolExecutor(4) as pool:
        ticks = list(pool.map(run, range(4)))
    assert sum(len(t.made) for t in ticks) == 2, "warm_min is 2: two rows in all"
    assert len(rows(db)) == 2


def test_the_tick_follows_the_pools_schedule(db: Database) -> None:
    always = [{"start": "00:00", "end": "00:00", "warm_min": 3}]  # a whole day, every day
    with db.session() as session:
        session.execute(update(Pool).where(Pool.id == POOL).values(warm_schedule=always))
    assert len(warm.tick(db, boot_timeout_s=300, seen_within_s=60).made) == 3
    with db.session() as session:
        session.execute(update(Pool).where(Pool.id == POOL).values(warm_schedule=[]))
    trimmed = warm.tick(db, boot_timeout_s=300, seen_within_s=60)
    assert [e.reason for e in trimmed.ended] == ["surplus"], "back to warm_min 2"


def test_idle_time_billed_on_warm_rows_counts_in_cost_reports_and_budgets(
    db: Database,
) -> None:
    from corral.shared.store.budgets import spend
    from corral.shared.store.ledger import WARM_PROJECT, CostGrouping, cost_report
    from corral.shared.store.models import Budget

    made(db, 1)
    with db.session() as session:  # past its idle TTL: the tick ends it and bills its idle time
        session.execute(update(WarmSandbox).values(ready_at=utcnow() - timedelta(seconds=601)))
    ended = warm.tick(db, boot_timeout_s=300, seen_within_s=60).ended
    assert [e.reason for e in ended] == ["idle_ttl"]
    (row,) = [r for r in rows(db).values() if r.end_reason == "idle_ttl"]
    amount = row.idle_amount_micros
    assert amount is not None and amount >= 30 * 1000  # made 30 s ago, 1000 a second
    by_pool = {r.key: r for r in cost_report(db, by=CostGrouping.POOL, org_id="acme")}
    assert by_pool[POOL].amount_micros == amount and by_pool[POOL].events == 1
    by_project = {r.key: r for r in cost_report(db, by=CostGrouping.PROJECT)}
    assert by_project[WARM_PROJECT].amount_micros == amount
    assert cost_report(db, org_id="someone-else") == []
    # The console's chart and CSV (spend per bucket) count it too, in the bucket it was billed.
    buckets = queries.cost_buckets(utcnow() - timedelta(hours=2))
    for by in CostGrouping:
        series = queries.cost_series(db, buckets, by, "acme")
        report = {r.key: r.amount_micros for r in cost_report(db, by=by, org_id="acme")}
        assert {key: sum(b["amount_micros"] for b in v) for key, v in series.items()} == report
        assert [sum(b["events"] for b in v) for v in series.values()] == [1]
    assert queries.cost_series(db, buckets, CostGrouping.POOL, "someone-else") == {}
    with db.session() as session:
        budget = Budget(id="b-warm", org_id="acme", pool_id=POOL, period="day", cap_micros=1)
        session.add(budget)
        session.flush()
        assert spend(session, budget).spend.billed_micros == amount


def _tick(db: Database) -> warm.Tick:
    return warm.tick(db, boot_timeout_s=300, seen_within_s=60)


def test_a_spent_budget_stops_warm_sandboxes_and_an_org_limit_caps_them(db: Database) -> None:
    from corral.shared.store.models import Budget
    from corral.shared.store.org_limits import set_limit

    with db.session() as session:
        set_limit(session, "acme", 1)
    assert len(_tick(db).made) == 1  # warm_min 2, but the org may hold 1 in flight
    with db.session() as session:
        set_limit(session, "acme", None)
    assert len(_tick(db).made) == 1  # and now the second
    with db.session() as session:  # a cap already passed: 0 may be spent today
        session.add(Budget(id="b-spent", org_id="acme", period="day", cap_micros=0))
    ticked = _tick(db)
    assert ticked.made == [] and sorted(e.reason for e in ticked.ended) == ["surplus"] * 2


def test_a_pool_changed_after_its_warm_sandboxes_were_made_never_binds_them(
    db: Database,
) -> None:
    ((old, _),) = made(db, 1)
    with db.session() as session:
        session.execute(
            update(WarmSandbox).where(WarmSandbox.id == old).values(last_seen_at=utcnow())
        )
        session.execute(update(Pool).where(Pool.id == POOL).values(sandbox_config={"x": 1}))
    (item,) = _routed(db, 1)
    assert bind_to(db, item, "sb-none") is None
    ticked = _tick(db)
    assert [(e.warm_id, e.reason) for e in ticked.ended] == [(old, "pool_changed")]
    assert len(ticked.made) == 2  # replaced, under the pool's settings as they are now


def _history(db: Database, ended: int, bound: int) -> list[str]:
    """``ended`` warm sandboxes ended long ago and ``bound`` bound ones (ids of their item
    sandboxes), statistics taken; the warm table's history, as a deployment keeps it."""
    long_ago = utcnow() - timedelta(days=30)
    common = {"pool_id": POOL, "org_id": "acme", "provider_id": "in-memory"}
    rows = [
        {**common, "id": f"wsb-old-{n}", "state": "ended", "ended_at": long_ago}
        for n in range(ended)
    ]
    sandboxes = [f"sb-{n:08d}-1" for n in range(bound)]  # bench.reaper's rows' ids
    rows += [
        {**common, "id": f"wsb-bound-{n}", "state": "bound", "sandbox_id": sandbox_id}
        for n, sandbox_id in enumerate(sandboxes)
    ]
    with db.session() as session:
        session.execute(insert(WarmSandbox), [{"created_at": long_ago, **row} for row in rows])
    with db.autocommit() as connection:
        connection.exec_driver_sql("ANALYZE warm_sandboxes")
    return sandboxes


def _warm_rows_read(db: Database) -> Callable[[], int]:
    """Counts the warm_sandboxes rows each transaction reads from here on (the largest);
    call the result to stop and read it."""
    most = [0]

    def after(conn: Any, cursor: Any, *_: Any) -> None:
        row = cursor.connection.execute(
            "SELECT coalesce(idx_tup_fetch, 0) + coalesce(seq_tup_read, 0) "
            "FROM pg_stat_xact_user_tables WHERE relname = 'warm_sandboxes'"
        ).fetchone()
        most[0] = max(most[0], int(row[0]) if row else 0)

    event.listen(db.engine, "after_cursor_execute", after)

    def stop() -> int:
        event.remove(db.engine, "after_cursor_execute", after)
        return most[0]

    return stop


def test_bound_warm_sandboxes_are_found_by_sandbox_not_among_every_one_ever_made(
    db: Database,
) -> None:
    sandboxes = _history(db, ended=5000, bound=2000)
    live = healthy_rows(range(10))  # the first ten bound sandboxes' items are running
    for item, sandbox in live:
        item["pool_id"] = sandbox["pool_id"] = POOL
    insert_rows(db, live)
    with db.autocommit() as connection:
        connection.exec_driver_sql("ANALYZE sandboxes")
    reading = _warm_rows_read(db)
    with db.session() as session:  # the reaper's live set, by the id the provider lists
        recorded = _recorded_live(session, "in-memory")
    live_read = reading()
    assert {listed: one.sandbox_id for listed, one in recorded.items()} == {
        f"wsb-bound-{n}": sandboxes[n] for n in range(10)
    }
    reading = _warm_rows_read(db)
    released = warm.release_bound(db, sandboxes[0])
    release_read = reading()
    assert [handle.external_id for handle in released] == ["wsb-bound-0"]
    # Without the index of migration 0019: 2,014 and 9,017 rows read.
    assert max(live_read, release_read) < 100, (live_read, release_read)


def test_warm_idle_time_is_summed_from_the_periods_rows_not_the_orgs_whole_history(
    db: Database,
) -> None:
    _history(db, ended=5000, bound=0)
    now = utcnow()
    common = {"pool_id": POOL, "org_id": "acme", "provider_id": "in-memory", "created_at": now}
    recent = [  # billed today: two ended unbound, one bound; one bound last month is not
        {**common, "id": "wsb-e1", "state": "ended", "ended_at": now, "idle_amount_micros": 5},
        {**common, "id": "wsb-e2", "state": "ended", "ended_at": now, "idle_amount_micros": 7},
        {**common, "id": "wsb-b1", "state": "bound", "bound_at": now, "idle_amount_micros": 11},
        {
            **common,
            "id": "wsb-b0",
            "state": "bound",
            "bound_at": now - timedelta(days=40),
            "ended_at": now,  # its item's sandbox ended today: not when its idle time ended
            "idle_amount_micros": 1000,
        },
    ]
    with db.session() as session:
        session.execute(insert(WarmSandbox), recent)
        session.add(Budget(id="b-day", org_id="acme", period="day", cap_micros=10**9))
    reading = _warm_rows_read(db)
    with db.session() as session:
        spent = spend(session, session.get_one(Budget, "b-day")).spend.billed_micros
    budget_read = reading()
    reading = _warm_rows_read(db)
    report = cost_report(db, by=CostGrouping.PROJECT, org_id="acme", since=now - timedelta(hours=1))
    report_read = reading()
    assert spent == 23
    assert [(row.key, row.events, row.amount_micros) for row in report] == [("(warm)", 3, 23)]
    # Reading coalesce(bound_at, ended_at) before migration 0020: 5,004 rows each.
    assert max(budget_read, report_read) < 100, (budget_read, report_read)
