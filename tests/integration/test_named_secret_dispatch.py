"""Dispatches that refer to named secrets, on real PostgreSQL: an unknown name is a dispatch
error naming it (on the batched intake of HTTP and the Celery consumer, and on the one-by-one
path), ``secret_env`` is read at the runner's claim and a binding's ``secret`` at provision,
each use recorded by name, and a secret deleted after the dispatch fails the item with
``unknown_secret`` instead of running it without. No stored payload carries a value."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from corral.cli.inspect import item_view, render_text
from corral.scheduler.batch import accept_batch
from corral.scheduler.intake import accept, route_item
from corral.shared.messages import DispatchRequest
from corral.shared.store import secrets
from corral.shared.store.db import Database
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import ItemState, WorkItem
from corral.worker.provision import Outcome, provision_item
from tests.integration import test_secret_key_change as key_change
from tests.integration.test_api import ADMIN, awaiting_item
from tests.seeding import SETTINGS

NEW_KEY = key_change.NEW_KEY
database_url = key_change.database_url  # the fixtures: a database with acme's pool
client_with_new_key = key_change.client_with_new_key

VALUE = "named-value-of-acme-4711"
SHORT = "s3cr3t-4711"  # short enough to be quoted whole where pydantic cuts a long input
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}


def _request(**fields: Any) -> DispatchRequest:
    return DispatchRequest.model_validate(
        {
            "org": "acme",
            "project": "web",
            "profile": "default",
            "work": {"kind": "shell", "command": "true"},
            **fields,
        }
    )


def _binding(**binding: str) -> dict[str, Any]:
    return {
        "allow_network": True,
        "allowed_hosts": ["api.example.test"],
        "secret_bindings": {"API_AUTH": {"host": "api.example.test", **binding}},
    }


def _routed(db: Database, request: DispatchRequest) -> str:
    """``request`` accepted and routed to acme's in-memory pool by hand (the in-memory
    provider runs no egress proxy, so routing would send an item with bindings nowhere)."""
    item_id = accept(db, request, actor="test").item_id
    with db.session() as session:
        item = session.get_one(WorkItem, item_id)
        item.pool_id, item.queue, item.attempts = "pool-mem", "provision.in-memory", 1
        transition(session, item, ItemState.ROUTED, actor="test")
    return item_id


def _item(db: Database, item_id: str) -> WorkItem:
    with db.session() as session:
        item = session.get_one(WorkItem, item_id)
        session.expunge(item)
    return item


def _claim(client: TestClient, token: str) -> tuple[int, dict[str, Any], str]:
    registered = client.post("/v1/runner/register", json={"token": token})
    assert registered.status_code == 200, registered.text
    headers = {"Authorization": f"Bearer {registered.json()['session_token']}"}
    answer = client.post("/v1/runner/claim", json={}, headers=headers)
    return answer.status_code, answer.json(), answer.text


@pytest.mark.parametrize("path", ["batch", "one_by_one"])
@pytest.mark.parametrize("refers", ["secret_env", "binding"])
def test_an_unknown_secret_is_a_dispatch_error_naming_it(
    database_url: str, tmp_path: Path, path: str, refers: str
) -> None:
    rt, _ = key_change.worker_runtime(database_url, tmp_path, NEW_KEY)
    db = rt.db
    try:
        secrets.set_secret(db, "globex", "nowhere-for-acme", VALUE)  # another org's: not seen
        fields: dict[str, Any] = (
            {"secret_env": {"API_TOKEN": "nowhere-for-acme"}}
            if refers == "secret_env"
            else {"egress": _binding(secret="nowhere-for-acme")}
        )
        request = _request(**fields)
        if path == "batch":  # the HTTP intake's and the Celery consumer's
            [taken] = accept_batch(db, [request], actor="test", settings=SETTINGS)
            item_id = taken.item_id
        else:
            item_id = accept(db, request, actor="test").item_id
            route_item(db, item_id, actor="test", settings=SETTINGS)
        item = _item(db, item_id)
        assert (item.state, item.error_code) == ("dispatch_error", "unknown_secret")
        field = "secret_env.API_TOKEN" if refers == "secret_env" else "egress.secret_bindings"
        assert field in (item.error_message or "")
        assert "nowhere-for-acme" in (item.error_message or "")
        assert VALUE not in json.dumps(item.payload)
    finally:
        db.dispose()


def test_secret_env_is_read_at_the_claim_and_its_use_recorded(
    client_with_new_key: tuple[TestClient, Database],
) -> None:
    client, db = client_with_new_key
    secrets.set_secret(db, None, "shared-token", "deployment-value")
    secrets.set_secret(db, "acme", "api-token", VALUE)
    item_id, token = awaiting_item(
        db, "acme", secret_env={"API_TOKEN": "api-token", "SHARED": "shared-token"}
    )
    assert VALUE not in json.dumps(_item(db, item_id).payload)

    status, answer, _ = _claim(client, token)
    assert status == 200
    assert answer["env"]["API_TOKEN"] == VALUE
    assert answer["env"]["SHARED"] == "deployment-value"

    uses = client.get(f"/v1/work-items/{item_id}/secret-uses", headers=ADMIN_HEADERS)
    assert uses.status_code == 200, uses.text
    assert [(u["name"], u["scope"], u["used_in"], u["target"]) for u in uses.json()["uses"]] == [
        ("api-token", "org", "env", "API_TOKEN"),
        ("shared-token", "deployment", "env", "SHARED"),
    ]
    shown = client.get(f"/v1/work-items/{item_id}", headers=ADMIN_HEADERS)
    assert VALUE not in uses.text + shown.text
    # `corral show`: the names, never the values.
    text = render_text(item_view(db, item_id, max_attempts=3))
    assert "secret     api-token (org) -> env API_TOKEN" in text
    assert "secret     shared-token (deployment) -> env SHARED" in text
    assert VALUE not in text and "deployment-value" not in text


def test_a_sandbox_repeating_its_claim_writes_no_more_uses(
    client_with_new_key: tuple[TestClient, Database],
) -> None:
    # A sandbox can play the runner: its claim, repeated at the runner's rate, must not
    # grow the control plane's database (a row per secret per claim before).
    client, db = client_with_new_key
    secrets.set_secret(db, "acme", "api-token", VALUE)
    item_id, token = awaiting_item(db, "acme", secret_env={"API_TOKEN": "api-token"})
    registered = client.post("/v1/runner/register", json={"token": token})
    headers = {"Authorization": f"Bearer {registered.json()['session_token']}"}
    for _ in range(20):  # the first claim and its repeats (an answer lost): each answered
        answer = client.post("/v1/runner/claim", json={}, headers=headers)
        assert answer.status_code == 200 and answer.json()["env"]["API_TOKEN"] == VALUE
    with db.session() as session:
        assert len(secrets.uses_of(session, item_id)) == 1


def test_a_secret_deleted_before_the_claim_fails_the_item_clearly(
    client_with_new_key: tuple[TestClient, Database],
) -> None:
    client, db = client_with_new_key
    secrets.set_secret(db, "acme", "api-token", VALUE)
    item_id, token = awaiting_item(db, "acme", secret_env={"API_TOKEN": "api-token"})
    assert secrets.delete_secret(db, "acme", "api-token")

    status, answer, text = _claim(client, token)
    assert status == 409
    assert answer["detail"]["error"] == "unknown_secret"
    assert "api-token" in answer["detail"]["message"]
    assert "secret_env.API_TOKEN" in answer["detail"]["message"]
    item = _item(db, item_id)
    assert (item.state, item.error_code) == ("failed", "unknown_secret")
    assert VALUE not in text + (item.error_message or "")
    with db.session() as session:
        assert secrets.uses_of(session, item_id) == []


def test_a_bindings_secret_is_read_at_provision_never_into_the_sandbox_env(
    database_url: str, tmp_path: Path
) -> None:
    rt, provider = key_change.worker_runtime(database_url, tmp_path, NEW_KEY)
    db = rt.db
    try:
        secrets.set_secret(db, "acme", "api-auth", f"Bearer {VALUE}")
        secrets.set_secret(db, "acme", "work-token", "work-value-0815")
        request = _request(
            egress=_binding(secret="api-auth", header="Authorization"),
            secret_env={"WORK_TOKEN": "work-token"},
        )
        item_id = _routed(db, request)
        assert provision_item(rt, item_id, actor="worker:test") is Outcome.PROVISIONED
        [box] = provider.boxes.values()
        binding = box.spec.egress.secret_bindings["API_AUTH"]
        assert binding.value.get_secret_value() == f"Bearer {VALUE}"
        env = json.dumps(box.spec.sandbox_env())
        assert VALUE not in env and "work-value-0815" not in env  # env comes at the claim
        assert "corral-secret-binding:API_AUTH" in env
        with db.session() as session:
            uses = secrets.uses_of(session, item_id)
        assert [(u["name"], u["used_in"], u["target"]) for u in uses] == [
            ("api-auth", "binding", "API_AUTH")
        ]
        assert VALUE not in json.dumps(_item(db, item_id).payload)
    finally:
        db.dispose()


@pytest.mark.parametrize("unfit", [None, "two\nlines", "Bearer \u0442\u0430\u0439\u043d\u0430"])
def test_a_bindings_secret_gone_or_unfit_at_provision_fails_the_item(
    database_url: str, tmp_path: Path, unfit: str | None
) -> None:
    rt, provider = key_change.worker_runtime(database_url, tmp_path, NEW_KEY)
    db = rt.db
    try:
        secrets.set_secret(db, "acme", "api-auth", VALUE)
        request = _request(egress=_binding(secret="api-auth"))
        item_id = _routed(db, request)
        if unfit is None:
            secrets.delete_secret(db, "acme", "api-auth")
        else:
            secrets.set_secret(db, "acme", "api-auth", unfit)
        assert provision_item(rt, item_id, actor="worker:test") is Outcome.FAILED
        assert "provision" not in provider.methods()
        item = _item(db, item_id)
        code = "unknown_secret" if unfit is None else "invalid_secret"
        assert (item.state, item.error_code) == ("failed", code)
        assert "egress.secret_bindings.API_AUTH" in (item.error_message or "")
        assert "api-auth" in (item.error_message or "")
        assert VALUE not in (item.error_message or "")
        with db.session() as session:
            assert secrets.uses_of(session, item_id) == []
    finally:
        db.dispose()


def _catalogue_with_a_kit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deployment's kit catalogue holds kit@1 (until the test drops it)."""
    catalogue = tmp_path / "kits.json"
    catalogue.write_text(json.dumps({"kit": {"1": {"check": "true", "env": {}}}}))
    monkeypatch.setenv("CORRAL_KIT_CATALOGUE", str(catalogue))


def _logged(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(
        f"{r.getMessage()} {r.exc_text or ''} {json.dumps(r.__dict__, default=str)}"
        for r in caplog.records
    )


def test_a_stored_message_no_longer_valid_at_the_claim_fails_the_item_naming_no_value(
    client_with_new_key: tuple[TestClient, Database], caplog: pytest.LogCaptureFixture
) -> None:
    # Dispatched while the catalogue had kit@1, which the deployment dropped since: its
    # message is validated again at the claim, opened. It was a 500 whose traceback (in the
    # api's log) quoted the opened toolchain, env values and all.
    caplog.set_level(logging.DEBUG)
    client, db = client_with_new_key
    item_id, token = awaiting_item(db, "acme", toolchain={"kits": ["kit@1"], "env": {"T": SHORT}})
    status, answer, text = _claim(client, token)
    assert status == 409, text
    assert answer["detail"]["error"] == "invalid_message"
    assert "toolchain" in answer["detail"]["message"]
    item = _item(db, item_id)
    assert (item.state, item.error_code) == ("failed", "invalid_message")
    assert SHORT not in text + (item.error_message or "") + _logged(caplog)


def test_a_stored_message_no_longer_valid_at_provision_fails_the_item_naming_no_value(
    database_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    rt, provider = key_change.worker_runtime(database_url, tmp_path, NEW_KEY)
    db = rt.db
    try:
        _catalogue_with_a_kit(tmp_path, monkeypatch)
        item_id = _routed(db, _request(toolchain={"kits": ["kit@1"], "env": {"T": SHORT}}))
        monkeypatch.delenv("CORRAL_KIT_CATALOGUE")  # the deployment dropped the kit since
        assert provision_item(rt, item_id, actor="worker:test") is Outcome.FAILED
        assert "provision" not in provider.methods()
        item = _item(db, item_id)
        assert (item.state, item.error_code) == ("failed", "invalid_message")
        assert "toolchain" in (item.error_message or "")
        assert SHORT not in (item.error_message or "") + _logged(caplog)
    finally:
        db.dispose()
