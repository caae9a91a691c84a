"""Registration tokens and runner sessions: shape, hashing at rest, single use, expiry."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta, timezone
from itertools import count

import pytest
from sqlalchemy import select

from corral.scheduler.admin import pools as admin
from corral.shared.store.db import Base, Database, utcnow
from corral.shared.store.models import RegistrationToken, RunnerSession, Sandbox, WorkItem
from corral.shared.store.tokens import (
    find_runner_session,
    hash_token,
    mint_registration_token,
    open_runner_session,
    redeem_registration_token,
    revoke_registration_tokens,
)

_numbers = count()


def make_sandbox(db: Database, *, org: str = "acme") -> Sandbox:
    """A sandbox row with the work item and pool its foreign keys need."""
    number = next(_numbers)
    pool = admin.create_pool(
        db, admin.PoolCreate(org_id=org, name=f"pool-{number}", provider_id="local")
    )
    with db.session() as session:
        item = WorkItem(
            id=f"wi-{number}",
            org_id=org,
            project_id="web",
            payload={},
            state="provisioning",
            pool_id=pool["id"],
        )
        sandbox = Sandbox(
            id=f"sb-{number}",
            work_item_id=item.id,
            attempt=1,
            org_id=org,
            pool_id=pool["id"],
            provider_id="local",
            status="provisioning",
        )
        session.add(item)
        session.flush()
        session.add(sandbox)
    return sandbox


def mint(db: Database, sandbox: Sandbox, ttl_s: float = 900) -> str:
    with db.session() as session:
        return mint_registration_token(session, sandbox, ttl_s=ttl_s)


def redeem(db: Database, token: str, now: datetime | None = None) -> RegistrationToken | None:
    with db.session() as session:
        return redeem_registration_token(session, token, now=now)


def open_session(db: Database, sandbox: Sandbox, expires_at: datetime) -> str:
    with db.session() as session:
        return open_runner_session(session, sandbox, expires_at=expires_at)


def find(db: Database, token: str, now: datetime | None = None) -> RunnerSession | None:
    with db.session() as session:
        return find_runner_session(session, token, now=now)


def every_stored_value(db: Database) -> str:
    """All columns of all rows of every table, as one string."""
    parts: list[str] = []
    with db.engine.connect() as connection:
        for table in Base.metadata.sorted_tables:
            for row in connection.execute(table.select()):
                parts.extend(repr(value) for value in row)
    return "\n".join(parts)


def test_tokens_have_their_prefix_and_enough_randomness(sqlite_db: Database) -> None:
    sandbox = make_sandbox(sqlite_db)
    registration = {mint(sqlite_db, sandbox) for _ in range(3)}
    session_token = open_session(sqlite_db, sandbox, utcnow() + timedelta(hours=1))
    assert len(registration) == 3
    for token in registration:
        assert token.startswith("crt_")
        assert len(token) >= len("crt_") + 43  # 32 bytes, URL-safe base64
    assert session_token.startswith("crs_")
    assert len(session_token) >= len("crs_") + 43


def test_only_the_sha256_is_stored(sqlite_db: Database) -> None:
    sandbox = make_sandbox(sqlite_db)
    registration = mint(sqlite_db, sandbox)
    bearer = open_session(sqlite_db, sandbox, utcnow() + timedelta(hours=1))

    with sqlite_db.session() as session:
        stored_hashes = set(session.scalars(select(RegistrationToken.token_hash)))
        session_hashes = set(session.scalars(select(RunnerSession.session_hash)))
    assert stored_hashes == {hashlib.sha256(registration.encode()).hexdigest()}
    assert session_hashes == {hash_token(bearer)}
    everything = every_stored_value(sqlite_db)
    for token in (registration, bearer):
        assert token not in everything
        assert token.split("_", 1)[1] not in everything  # not even without its prefix


def test_a_registration_token_redeems_once(sqlite_db: Database) -> None:
    sandbox = make_sandbox(sqlite_db)
    token = mint(sqlite_db, sandbox)

    first = redeem(sqlite_db, token)
    assert first is not None
    assert (first.sandbox_id, first.work_item_id) == (sandbox.id, sandbox.work_item_id)
    assert first.redeemed_at is not None
    assert redeem(sqlite_db, token) is None


def test_each_token_is_bound_to_its_own_sandbox(sqlite_db: Database) -> None:
    one, two = make_sandbox(sqlite_db), make_sandbox(sqlite_db)
    token_one, token_two = mint(sqlite_db, one), mint(sqlite_db, two)
    redeemed_two = redeem(sqlite_db, token_two)
    redeemed_one = redeem(sqlite_db, token_one)
    assert redeemed_two is not None and redeemed_two.sandbox_id == two.id
    assert redeemed_one is not None and redeemed_one.sandbox_id == one.id


def test_an_expired_token_does_not_redeem(sqlite_db: Database) -> None:
    sandbox = make_sandbox(sqlite_db)
    token = mint(sqlite_db, sandbox, ttl_s=60)
    assert redeem(sqlite_db, token, now=utcnow() + timedelta(seconds=61)) is None
    # The failed attempt did not use it up: it still redeems within its lifetime.
    assert redeem(sqlite_db, token, now=utcnow() + timedelta(seconds=30)) is not None


def test_expiry_compares_instants_not_wall_clock_text(sqlite_db: Database) -> None:
    sandbox = make_sandbox(sqlite_db)
    token = mint(sqlite_db, sandbox, ttl_s=3600)
    # Ten minutes from now, written in a zone five hours ahead of UTC: still valid.
    ahead = (utcnow() + timedelta(minutes=10)).astimezone(timezone(timedelta(hours=5)))
    assert redeem(sqlite_db, token, now=ahead) is not None


@pytest.mark.parametrize(
    "made_up",
    [
        "crt_" + "A" * 43,
        "crt_",
        "",
        "not-a-token",
        "crs_" + "A" * 43,
    ],
    ids=["unknown-crt", "bare-prefix", "empty", "no-prefix", "session-prefix"],
)
def test_unknown_tokens_do_not_redeem(sqlite_db: Database, made_up: str) -> None:
    mint(sqlite_db, make_sandbox(sqlite_db))
    assert redeem(sqlite_db, made_up) is None


def test_a_real_token_under_another_prefix_does_not_redeem(sqlite_db: Database) -> None:
    sandbox = make_sandbox(sqlite_db)
    token = mint(sqlite_db, sandbox)
    body = token.removeprefix("crt_")
    assert redeem(sqlite_db, "crs_" + body) is None
    assert redeem(sqlite_db, body) is None
    assert redeem(sqlite_db, token) is not None  # the wrong guesses did not burn it


def test_revoke_makes_unredeemed_tokens_unusable(sqlite_db: Database) -> None:
    sandbox, other = make_sandbox(sqlite_db), make_sandbox(sqlite_db)
    first, second = mint(sqlite_db, sandbox), mint(sqlite_db, sandbox)
    spared = mint(sqlite_db, other)

    with sqlite_db.session() as session:
        revoke_registration_tokens(session, sandbox.id)

    assert redeem(sqlite_db, first) is None
    assert redeem(sqlite_db, second) is None
    assert redeem(sqlite_db, spared) is not None


def test_revoke_keeps_the_redeemed_at_of_used_tokens(sqlite_db: Database) -> None:
    sandbox = make_sandbox(sqlite_db)
    used = redeem(sqlite_db, mint(sqlite_db, sandbox))
    assert used is not None and used.redeemed_at is not None
    with sqlite_db.session() as session:
        revoke_registration_tokens(session, sandbox.id)
        row = session.get(RegistrationToken, used.id)
        assert row is not None
        assert row.redeemed_at == used.redeemed_at


def test_runner_session_is_found_by_its_token_until_it_expires(sqlite_db: Database) -> None:
    sandbox = make_sandbox(sqlite_db)
    expires = datetime(2100, 1, 1, tzinfo=UTC)
    bearer = open_session(sqlite_db, sandbox, expires)

    found = find(sqlite_db, bearer)
    assert found is not None
    assert (found.sandbox_id, found.work_item_id, found.org_id) == (
        sandbox.id,
        sandbox.work_item_id,
        "acme",
    )
    assert found.expires_at == expires
    assert find(sqlite_db, bearer, now=expires - timedelta(seconds=1)) is not None
    assert find(sqlite_db, bearer, now=expires) is None
    assert find(sqlite_db, bearer, now=expires + timedelta(days=1)) is None


def test_runner_session_lookup_refuses_other_tokens(sqlite_db: Database) -> None:
    sandbox = make_sandbox(sqlite_db)
    bearer = open_session(sqlite_db, sandbox, utcnow() + timedelta(hours=1))
    registration = mint(sqlite_db, sandbox)
    assert find(sqlite_db, "crs_" + "A" * 43) is None
    assert find(sqlite_db, registration) is None
    assert find(sqlite_db, "crt_" + bearer.removeprefix("crs_")) is None
    assert find(sqlite_db, bearer.removeprefix("crs_")) is None
    assert find(sqlite_db, bearer) is not None
