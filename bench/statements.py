"""The two statements on the way from a dispatch to ``provision()``, beside the durable
anchor's one-row statements, in the same run: what the database asks of corral's path.

The latency benchmark (bench/latency.py) sets corral beside two Celery hops and beside two
durable hops, whose first commits a one-row INSERT and whose second a one-row UPDATE. This
one takes the statements alone, each a round trip and a commit on an autocommit connection:

- the anchor's one-row INSERT and UPDATE (a table of their own: a key, a state, a time);
- corral's intake write of one item (:data:`corral.scheduler.batch._ONE_POOL_WRITE`: the
  item's row, its two events, its pool's slot counter), through psycopg alone;
- corral's claim of that item (:data:`corral.worker.claims._CLAIM`: its move, a sandbox row,
  a token's hash, two events), through psycopg alone, and as the provider worker runs it
  (:func:`corral.worker.claims.claim_routed`: the token, the parameters, SQLAlchemy, the rows);
- ``SELECT 1``: a round trip with nothing to write.

psycopg prepares each statement (PostgreSQL then runs its generic plan, as in the
services). The kinds take turns, with a pause before each (``--pause-ms``): at 20
dispatches a second a backend and a process woken by a message find their caches cold, and
a statement costs two to five times what it does in a loop. Medians and p90 in ms.

Usage: python -m bench.statements [--rounds 200] [--pause-ms 50] [--smoke]
(PostgreSQL on 127.0.0.1)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
from sqlalchemy import Table, text
from sqlalchemy.engine import make_url

from bench.dispatch import fresh_database, seed
from bench.harness import add_smoke_flag, say_smoke
from corral.scheduler.batch import _ONE_POOL_WRITE, _as_json, _with_defaults
from corral.shared.store.db import Database, make_engine, utcnow
from corral.shared.store.lifecycle import event_row
from corral.shared.store.models import WorkItem
from corral.shared.store.tokens import REGISTRATION_PREFIX, hash_token, new_token
from corral.worker.claims import _CLAIM, ClaimRequest, claim_routed

_ITEMS: Table = WorkItem.__table__  # type: ignore[assignment]


class _Statements:
    """Each kind's statement, and what it is given, on one database."""

    def __init__(self, db: Database, connection: psycopg.Connection[Any]) -> None:
        self.db, self.connection = db, connection
        with db.engine.connect() as probe:
            self.dialect = probe.dialect
            self.pool_id = probe.execute(text("SELECT id FROM pools")).scalar_one()
        connection.execute(
            "CREATE TABLE bench_items (id bigint PRIMARY KEY, state text NOT NULL, "
            "created_at timestamptz NOT NULL)"
        )

    def run(self, sql: str, parameters: Any) -> None:
        cursor = self.connection.execute(sql, parameters, prepare=True)
        if cursor.description is not None:
            cursor.fetchall()
        if cursor.rowcount < 1:  # a claim or an update that found nothing to do
            raise RuntimeError(f"nothing done by: {sql[:60]}")

    def select_1(self) -> None:
        self.run("SELECT 1", ())

    def anchor_insert(self, number: int) -> None:
        self.run(
            "INSERT INTO bench_items (id, state, created_at) VALUES (%s, 'routed', now())",
            (number,),
        )

    def anchor_update(self, number: int) -> None:
        self.run(
            "UPDATE bench_items SET state = 'claimed' WHERE id = %s AND state = 'routed' "
            "RETURNING id",
            (number,),
        )

    def write(self, item_id: str) -> None:
        now = utcnow()
        item = {
            "id": item_id,
            "org_id": "org-0",
            "project_id": "bench",
            "payload": {"work": {"kind": "shell", "command": "true"}},
            "state": "routed",
            "pool_id": self.pool_id,
            "created_at": now,
            "updated_at": now,
            "routed_at": now,
        }
        events = [
            event_row(item_id, None, "received", actor="bench", at=now, detail="accepted"),
            event_row(item_id, "received", "routed", actor="bench", at=now),
        ]
        given = {
            "pool_id": self.pool_id,
            "count": 1,
            "slot_limit": 10**9,
            "config_version": None,
            "items": _as_json(_with_defaults(_ITEMS, [item])),
            "events": _as_json(events),
        }
        self.run(*_ONE_POOL_WRITE.compiled(self.dialect).render(given))

    def claim(self, item_id: str) -> None:
        now = utcnow()
        given = {
            "ids": [item_id],
            "item_ids": [item_id],
            "actors": ["bench"],
            "holders": ["bench#0"],
            "hashes": [hash_token(new_token(REGISTRATION_PREFIX))],
            "expires": now + timedelta(minutes=10),
            "held_until": now + timedelta(minutes=1),
            "now": now,
        }
        self.run(*_CLAIM.compiled(self.dialect).render(given))

    def claim_as_corral(self, item_id: str) -> None:
        [fresh] = claim_routed(
            self.db, [ClaimRequest(item_id, "bench", "bench#0")], lease_s=60, token_ttl_s=600
        )
        if fresh is None:
            raise RuntimeError(f"{item_id} was not claimed")


def measure(rounds: int, pause_s: float) -> dict[str, list[float]]:
    """Seconds per statement, by kind, over ``rounds`` rounds (the first five left out: the
    statements are prepared and their plans made then)."""
    with fresh_database() as url:
        db = Database(make_engine(url))
        seed(db, orgs=1, pools_per_org=1)
        plain = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        with psycopg.connect(plain, autocommit=True) as connection:
            statements = _Statements(db, connection)
            # per kind: what it needs done first (not timed), and what is timed
            kinds: dict[str, tuple[Callable[[int], None] | None, Callable[[int], None]]] = {
                "SELECT 1": (None, lambda _: statements.select_1()),
                "anchor: one-row INSERT": (None, statements.anchor_insert),
                "anchor: one-row UPDATE": (None, statements.anchor_update),
                "corral: intake write, psycopg": (
                    None,
                    lambda n: statements.write(f"wi-a{n:07d}"),
                ),
                "corral: claim, psycopg": (None, lambda n: statements.claim(f"wi-a{n:07d}")),
                "corral: claim, as the worker runs it": (
                    lambda n: statements.write(f"wi-b{n:07d}"),
                    lambda n: statements.claim_as_corral(f"wi-b{n:07d}"),
                ),
            }
            took: dict[str, list[float]] = {kind: [] for kind in kinds}
            for number in range(rounds + 5):
                for kind, (before, statement) in kinds.items():
                    if before is not None:
                        before(number)
                    time.sleep(pause_s)
                    started = time.perf_counter()
                    statement(number)
                    if number >= 5:
                        took[kind].append(time.perf_counter() - started)
        db.dispose()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--pause-ms", type=float, default=50)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.pause_ms = 3, 1
    say_smoke(args.smoke)
    took = measure(args.rounds, args.pause_ms / 1000)
    for kind, seconds in took.items():
        ordered = sorted(seconds)
        p90 = ordered[int(0.9 * (len(ordered) - 1))]
        print(
            f"{kind:40s} p50 {statistics.median(seconds) * 1000:5.2f} ms  p90 {p90 * 1000:5.2f} ms"
        )


if __name__ == "__main__":
    main()
