"""What an operator reads and does on the console, through the api app on PostgreSQL: the
overview's processes-and-queues panel, the providers' capabilities as readable cells, an
amount's or rate's unit, panels left out when they can never fill, and the whole pool form
(lease, warm sandboxes, delete, its items)."""

from __future__ import annotations

import re
import uuid

from sqlalchemy import select

from corral.scheduler.admin.pools import PoolCreate, create_pool
from corral.shared.store import liveness
from corral.shared.store.api_keys import create_key
from corral.shared.store.db import Database, utcnow
from corral.shared.store.models import ItemState, Pool, WorkItem
from tests.integration.api_clients import ClientFactory
from tests.integration.test_api import awaiting_item
from tests.integration.test_console import logged_in, org, text_of


def item_row(db: Database, org_id: str, state: ItemState, **fields: object) -> str:
    """A work item of ``org_id`` in ``state`` as it is stored, with ``fields``."""
    item_id = f"wi-{uuid.uuid4().hex}"
    with db.session() as session:
        session.add(
            WorkItem(
                id=item_id,
                org_id=org_id,
                project_id="web",
                profile="default",
                payload={},
                state=state.value,
                **fields,
            )
        )
    return item_id


def row_of(html: str, row_id: str) -> str:
    found = re.search(rf'<tr id="{re.escape(row_id)}"[^>]*>(.*?)</tr>', html, re.S)
    assert found is not None, row_id
    return text_of(found.group(0))


def test_the_overview_shows_processes_and_queues_and_flags_work_no_one_consumes(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    logged_in(client)
    served, unserved = f"provision.c{uuid.uuid4().hex[:8]}", f"provision.u{uuid.uuid4().hex[:8]}"
    process = f"worker-console@host-{uuid.uuid4().hex[:6]}:41"
    liveness.record_consumer(pg_db, [served], process, utcnow())
    owner = org()
    item_row(pg_db, owner, ItemState.ROUTED, queue=unserved, routed_at=utcnow())
    page = client.get("/console/overview").text
    assert 'id="processes-panel"' in page
    assert re.search(rf"{re.escape(process)}\s+{re.escape(served)}\s+\d+ s ago", text_of(page))
    assert "1 0 0 consumed" in " ".join(row_of(page, f"queue-{served}").split()[1:])
    flagged = row_of(page, f"queue-{unserved}")
    assert "work waiting, no consumer" in flagged
    assert re.search(rf'<tr id="queue-{unserved}" class="unserved"', page)
    # An org's login sees its own pools' queues and items: no process, no broker count.
    with pg_db.session() as session:
        _, key = create_key(session, owner, "console", ["read"])
    mine = make_client()
    logged_in(mine, key)
    page = mine.get("/console/overview").text
    assert f"queue-{unserved}" in page and f"queue-{served}" not in page
    assert 'id="processes"' not in page and process not in page
    assert "messages waiting on the broker" not in page


def test_the_providers_page_shows_cells_not_json_nor_python_values(
    make_client: ClientFactory,
) -> None:
    client = make_client()
    logged_in(client)
    page = client.get("/console/providers").text
    table = re.search(r'<table class="list matrix" id="providers">.*?</table>', page, re.S)
    assert table is not None
    cells = [text_of(c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", table[0], re.S)]
    assert "\N{CHECK MARK}" in cells and "\N{EN DASH}" in cells
    shown = text_of(table[0])
    for python_or_json in ("True", "False", "None", "null", "[", "{", '"'):
        assert python_or_json not in shown, python_or_json
    assert "substrate: runtime kinds" in shown and "no limit" in shown
    assert "30 s" in shown  # agentrun's max session duration, with its unit


def test_amounts_and_rates_carry_their_unit(make_client: ClientFactory, pg_db: Database) -> None:
    client = make_client(cost_unit="EUR")
    logged_in(client)
    item_id, _ = awaiting_item(pg_db, org())
    with pg_db.session() as session:
        pool = session.get_one(Pool, session.get_one(WorkItem, item_id).pool_id)
        pool.rate_micros, pool_id = 250_000, pool.id
    page = text_of(client.get(f"/console/pools/{pool_id}").text)
    assert "fixed (the provider's): 0.250000 EUR a sandbox session" in page
    assert "µ/unit" not in page and "Rate (µEUR)" in page
    costs = text_of(client.get("/console/costs?since=24h").text)
    assert "amount (EUR)" in costs and "Amounts in EUR" in costs
    overview = client.get("/console/overview").text
    assert "items per bucket" in overview or "none per bucket" in overview


def test_an_item_that_ended_without_a_sandbox_shows_no_empty_panels(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    logged_in(client)
    refused = item_row(
        pg_db,
        org(),
        ItemState.DISPATCH_ERROR,
        error_code="no_eligible_pool",
        error_message="no active pool provides requirement gpu",
    )
    page = client.get(f"/console/items/{refused}").text
    assert "no_eligible_pool" in text_of(page)
    for panel in ('id="sandboxes"', 'id="log-lines"', 'id="result"', "none yet"):
        assert panel not in page, panel
    waiting, _ = awaiting_item(pg_db, org())  # not ended: its panels may still fill
    page = client.get(f"/console/items/{waiting}").text
    assert 'id="sandboxes"' in page and 'id="log-lines"' in page and "none yet" in page


def test_the_pool_form_sets_lease_and_warm_fields_links_its_items_and_deletes_it(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    csrf = logged_in(client)
    owner = org()
    pool = create_pool(pg_db, PoolCreate(org_id=owner, name="build", provider_id="local"))
    page = client.get(f"/console/pools/{pool['id']}").text
    assert f'href="/console/items?pool={pool["id"]}"' in page
    for field in ("lease-max_attempts", "lease-on_heartbeat_lost", "warm_min", "warm_schedule"):
        assert f'id="{field}"' in page, field
    form = {
        "csrf": csrf,
        "priority": "1",
        "max_concurrent": "4",
        "max_concurrent_ceiling": "6",
        "warm_min": "1",
        "warm_idle_ttl_s": "120",
        "warm_schedule": '[{"days": ["mon"], "start": "08:00", "end": "18:00", "warm_min": 2}]',
        "lease.max_attempts": "3",
        "lease.on_heartbeat_lost": "requeue",
        "lease.backoff_s": "10",
    }
    saved = client.post(f"/console/pools/{pool['id']}", data=form)
    assert saved.status_code == 200, text_of(saved.text)
    with pg_db.session() as session:
        row = session.get_one(Pool, pool["id"])
        assert row.lease == {"max_attempts": 3, "on_heartbeat_lost": "requeue", "backoff_s": 10}
        assert (row.warm_min, row.warm_idle_ttl_s, row.max_concurrent_ceiling) == (1, 120, 6)
        assert row.warm_schedule and row.warm_schedule[0]["warm_min"] == 2
    shown = text_of(saved.text)
    assert "max attempts: 3; on heartbeat lost: requeue; backoff s: 10 s" in shown
    refused = client.post(f"/console/pools/{pool['id']}", data={**form, "lease.max_attempts": "0"})
    assert refused.status_code == 422 and "max_attempts" in text_of(refused.text)
    # No field of the lease filled: the pool's policy is cleared.
    cleared = {k: v for k, v in form.items() if not k.startswith("lease.")}
    assert client.post(f"/console/pools/{pool['id']}", data=cleared).status_code == 200
    with pg_db.session() as session:
        assert session.get_one(Pool, pool["id"]).lease is None
    # Delete: a page that asks, then the post (with the session's CSRF token).
    asked = client.get(f"/console/pools/{pool['id']}/delete")
    assert asked.status_code == 200 and 'id="confirm-delete"' in asked.text
    forged = client.post(f"/console/pools/{pool['id']}/delete", data={"csrf": "forged"})
    assert forged.status_code == 403
    deleted = client.post(f"/console/pools/{pool['id']}/delete", data={"csrf": csrf})
    assert deleted.status_code == 200 and 'id="pools"' in deleted.text
    with pg_db.session() as session:
        assert session.get_one(Pool, pool["id"]).deleted_at is not None


def test_a_pool_with_items_in_flight_is_not_deleted_and_an_org_key_may_not_delete(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    csrf = logged_in(client)
    owner = org()
    item_id, _ = awaiting_item(pg_db, owner)
    with pg_db.session() as session:
        pool_id = session.get_one(WorkItem, item_id).pool_id
    refused = client.post(f"/console/pools/{pool_id}/delete", data={"csrf": csrf})
    assert refused.status_code == 409 and "in flight" in text_of(refused.text)
    with pg_db.session() as session:
        _, key = create_key(session, owner, "console", ["read", "admin"])
    theirs = make_client()
    their_csrf = logged_in(theirs, key)
    page = theirs.get(f"/console/pools/{pool_id}").text
    assert 'id="delete-pool"' not in page
    denied = theirs.post(f"/console/pools/{pool_id}/delete", data={"csrf": their_csrf})
    assert denied.status_code == 403
    with pg_db.session() as session:
        found = session.scalars(select(Pool.deleted_at).where(Pool.id == pool_id)).one()
        assert found is None
