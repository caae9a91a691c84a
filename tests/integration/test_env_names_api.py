"""Hostile env names and values over HTTP, on the api with PostgreSQL: a dispatch, a session's
creation and an exec are refused with a 422 naming the field, store nothing, and echo neither
the name (unless corral's own list names it) nor the value."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select

from corral.shared.store.db import Database
from corral.shared.store.models import InteractiveSession, WorkItem
from tests.integration.api_clients import ClientFactory
from tests.integration.test_api import ADMIN
from tests.seeding import org_with_pool

HEADERS = {"Authorization": f"Bearer {ADMIN}"}
PLANTED = "/tmp/planted-by-an-earlier-item.so"
LOADER = "LD_PRELOAD is refused: the dynamic loader acts on it"
NOT_A_NAME = "a name is not an environment variable name"


def _dispatch(org: str, **fields: Any) -> dict[str, Any]:
    return {
        "org": org,
        "project": "web",
        "profile": "default",
        "work": {"kind": "shell", "command": "true"},
        **fields,
    }


def _rows(db: Database, org: str) -> tuple[int, int]:
    with db.session() as session:
        items = session.scalar(select(func.count()).where(WorkItem.org_id == org))
        sessions = session.scalar(select(func.count()).where(InteractiveSession.org_id == org))
    return items or 0, sessions or 0


def _refused(answer: Any) -> list[dict[str, str]]:
    assert answer.status_code == 422, answer.text
    assert PLANTED not in answer.text and "EVIL" not in answer.text
    detail: list[dict[str, str]] = answer.json()["detail"]
    return detail


def test_a_dispatch_with_a_loader_or_malformed_env_name_is_422_naming_env(
    make_client: ClientFactory, pg_db: Database
) -> None:
    # A body limit raised past 10 MB: the message's own bound refuses the value.
    client = make_client(api_body_limit_dispatch=16 * 1024 * 1024)
    org = org_with_pool(pg_db, "env")
    cases = [
        ({"env": {"LD_PRELOAD": PLANTED}}, "env", LOADER),
        ({"env": {"EVIL=1 LD_PRELOAD": PLANTED}}, "env", NOT_A_NAME),
        ({"toolchain": {"env": {"LD_PRELOAD": PLANTED}}}, "toolchain", f"toolchain.env: {LOADER}"),
        ({"env": {"BIG": "x" * 10 * 1024 * 1024}}, "env", "a value is too long"),
    ]
    for fields, field, message in cases:
        answer = client.post("/v1/dispatch", json=_dispatch(org, **fields), headers=HEADERS)
        [problem] = _refused(answer)
        assert answer.json()["error"] == "invalid_message"
        assert problem["field"] == field
        assert problem["message"].startswith(message)
    assert _rows(pg_db, org) == (0, 0)
    ordinary = _dispatch(org, env={"CI": "true", "node_env": "ci"})
    assert client.post("/v1/dispatch", json=ordinary, headers=HEADERS).status_code == 202


def test_a_session_and_an_exec_with_a_loader_env_name_are_422_naming_env(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    org = org_with_pool(pg_db, "env")
    body = {"org": org, "project": "p", "profile": "default"}
    for fields, field, message in [
        ({"env": {"LD_PRELOAD": PLANTED}}, "env", LOADER),
        ({"env": {"A=B": PLANTED}}, "env", NOT_A_NAME),
        ({"toolchain": {"env": {"LD_PRELOAD": PLANTED}}}, "toolchain", f"toolchain.env: {LOADER}"),
    ]:
        [problem] = _refused(client.post("/v1/sessions", json={**body, **fields}, headers=HEADERS))
        assert problem["field"] == field
        assert problem["message"].startswith(message)
    assert _rows(pg_db, org) == (0, 0)
    # An exec's env is checked before its session is looked for.
    for env, message in [({"LD_PRELOAD": PLANTED}, LOADER), ({"A=B": PLANTED}, NOT_A_NAME)]:
        answer = client.post(
            "/v1/sessions/se-none/exec", json={"command": ["true"], "env": env}, headers=HEADERS
        )
        [problem] = _refused(answer)
        assert problem["field"] == "env"
        assert problem["message"].startswith(message)
    ordinary = {"command": ["true"], "env": {"CI": "1"}}
    answer = client.post("/v1/sessions/se-none/exec", json=ordinary, headers=HEADERS)
    assert answer.status_code == 404
