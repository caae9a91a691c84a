"""corral.client's work-item clients against real processes (the api, the scheduler, a
local provider worker, the maintenance worker and beat, on PostgreSQL and Redis), with an
org key made through the admin api."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest

from corral.cli.api_target import publish
from corral.client import (
    AsyncClient,
    Client,
    ConflictError,
    ForbiddenError,
    NotFoundError,
    UnauthorizedError,
)
from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack

WAIT_S = 120


@pytest.fixture(scope="module")
def org(stack: Stack) -> str:
    return stack.make_org("client")


@pytest.fixture(scope="module")
def key(stack: Stack, org: str) -> str:
    """An org key that dispatches, reads and reviews."""
    made = {"name": "client tests", "scopes": ["dispatch", "read", "review"]}
    status, body = stack.request("POST", f"/v1/admin/orgs/{org}/keys", made)
    assert status == 201, body
    return str(body["key"])


def _message(org: str, project: str, command: str, **fields: Any) -> dict[str, Any]:
    return {**shell(org, command, **fields), "project": project}


def test_dispatch_wait_list_follow_and_cancel(stack: Stack, org: str, key: str) -> None:
    tag = uuid.uuid4().hex[:8]
    project = f"p-{tag}"
    with Client(stack.api_url, key) as corral:
        first = corral.dispatch(_message(org, project, f"echo one-{tag}; echo two-{tag}"))
        second = corral.dispatch(_message(org, project, "exit 3"), idempotency_key=f"k-{tag}")
        assert first.created and second.idempotency_key == f"k-{tag}"
        # The same key again answers the same item.
        again = corral.dispatch(_message(org, project, "exit 3"), idempotency_key=f"k-{tag}")
        assert (again.id, again.created) == (second.id, False)

        lines = [
            (line.stream, line.line)
            for line in corral.logs(first.id, follow=True, poll_interval_s=0.2)
        ]
        # The runner's own lines (system) around the work's.
        assert [text for stream, text in lines if stream == "stdout"] == [
            f"one-{tag}",
            f"two-{tag}",
        ]
        assert lines[0] == ("system", f"work: echo one-{tag}; echo two-{tag}")
        assert corral.wait(first.id, timeout_s=WAIT_S).state == "succeeded"
        failed = corral.wait(second.id, timeout_s=WAIT_S)
        assert (failed.state, failed.exit_code, failed.error and failed.error.code) == (
            "failed",
            3,
            "work_failed",
        )

        assert [row.id for row in corral.list(idempotency_key=f"k-{tag}")] == [second.id]
        # Newest first, a page an item: the cursor is followed to the last page.
        assert [row.id for row in corral.list(project=project, limit=1)] == [second.id, first.id]
        assert [row.id for row in corral.list(project=project, state="failed")] == [second.id]

        events = corral.events(first.id)
        assert ("work_item", "succeeded") in [(e.entity, e.to) for e in events]

        long = corral.dispatch(_message(org, project, "sleep 120"))
        assert corral.cancel(long.id).state == "cancelled"
        assert corral.wait(long.id, timeout_s=WAIT_S).state == "cancelled"


def test_refusals_are_typed_errors(stack: Stack, org: str, key: str) -> None:
    with Client(stack.api_url, key) as corral:
        with pytest.raises(NotFoundError):
            corral.get("wi-does-not-exist")
        with pytest.raises(ForbiddenError):
            corral.dispatch(_message("another-org", "p", "true"))
    with Client(stack.api_url, "cok_not-a-key") as stranger, pytest.raises(UnauthorizedError):
        stranger.get("wi-does-not-exist")


def test_a_bundle_is_downloaded_and_accepted_by_its_digest(
    stack: Stack, org: str, key: str, tmp_path: Path
) -> None:
    review = {"required": True}
    with Client(stack.api_url, key) as corral:
        sent = corral.dispatch(_message(org, "bundles", "echo hi > made.txt", review=review))
        assert corral.wait(sent.id, timeout_s=WAIT_S).state == "succeeded"
        digest = corral.bundle(sent.id, tmp_path / "bundle.tar.gz")
        assert (tmp_path / "bundle.tar.gz").stat().st_size > 0
        with pytest.raises(ConflictError) as changed:
            corral.accept_bundle(sent.id, "0" * 64)
        assert changed.value.error == "bundle_changed"
        assert corral.accept_bundle(sent.id, digest).review == "accepted"


def test_the_async_client_does_the_same_concurrently(stack: Stack, org: str, key: str) -> None:
    tag = uuid.uuid4().hex[:8]
    project = f"a-{tag}"

    async def follow(corral: AsyncClient, item_id: str) -> list[str]:
        lines = corral.logs(item_id, follow=True, poll_interval_s=0.2)
        return [line.line async for line in lines if line.stream == "stdout"]

    async def scenario() -> None:
        async with AsyncClient(stack.api_url, key) as corral:
            sent = await asyncio.gather(
                *(
                    corral.dispatch(
                        _message(org, project, f"echo {n}-{tag}"), idempotency_key=f"{n}-{tag}"
                    )
                    for n in ("a", "b")
                ),
                corral.dispatch(_message(org, project, "sleep 120")),
            )
            first, second, long = (one.id for one in sent)
            cancelled, logs_a, logs_b = await asyncio.gather(
                corral.cancel(long), follow(corral, first), follow(corral, second)
            )
            assert cancelled.state == "cancelled"
            assert (logs_a, logs_b) == ([f"a-{tag}"], [f"b-{tag}"])
            views = await asyncio.gather(
                *(corral.wait(one, timeout_s=WAIT_S) for one in (first, second, long))
            )
            assert [v.state for v in views] == ["succeeded", "succeeded", "cancelled"]
            listed = [row.id async for row in corral.list(idempotency_key=f"b-{tag}")]
            assert listed == [second]
            assert {row.id async for row in corral.list(project=project, limit=2)} == {
                first,
                second,
                long,
            }

    asyncio.run(scenario())


def test_the_environment_and_corral_devs_files_find_the_api(
    stack: Stack, key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("CORRAL_API_URL", "CORRAL_API_KEY", "CORRAL_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    # corral dev's files: its api URL and the admin token.
    monkeypatch.setenv("CORRAL_STATE_DIR", str(tmp_path))
    publish(tmp_path, stack.api_url, stack.admin_token)
    with Client() as corral:
        assert corral.target.url == stack.api_url
        assert next(corral.list(org="client", limit=1)).org == "client"
    # The environment, here with the api's Unix socket and the org key.
    monkeypatch.setenv("CORRAL_API_URL", f"unix://{stack.state_dir / 'run' / 'api.sock'}")
    monkeypatch.setenv("CORRAL_API_KEY", key)
    with Client() as corral:
        assert corral.target.socket is not None
        with pytest.raises(NotFoundError):
            corral.get("wi-does-not-exist")
        assert {row.org for row in corral.list(limit=2)} == {"client"}  # the key's org alone
