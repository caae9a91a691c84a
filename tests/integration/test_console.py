"""The web console (``/console``) through the api app on real PostgreSQL: its login and
session cookie, CSRF, the pages and what they show, org scoping, and its forms."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import re
import uuid
from datetime import UTC, datetime, timedelta
from html import unescape

from fastapi.testclient import TestClient
from httpx import Response
from pydantic import SecretStr
from sqlalchemy import delete, select

from corral.scheduler.api.console import queries
from corral.scheduler.api.console import session as sessions
from corral.shared import runtime
from corral.shared.keyring import Keyring
from corral.shared.store import secrets, webhook_log, webhooks
from corral.shared.store.api_keys import create_key, revoke_key
from corral.shared.store.db import Database
from corral.shared.store.models import (
    ApiKey,
    ConsoleSessionRecord,
    CostEvent,
    LifecycleEvent,
    OutcomeOutbox,
    Pool,
    Sandbox,
    WebhookEndpoint,
    WorkItem,
    WorkItemLog,
)
from corral.shared.store.outbox import OutboxRow
from corral.shared.store.tokens import hash_token
from tests.conftest import TEST_SECRET_KEY
from tests.integration.api_clients import ClientFactory, api_routes
from tests.integration.test_api import ADMIN, admin_headers, awaiting_item
from tests.integration.test_bundles_api import GZIP, bundle, downloaded_sha256, running


def org() -> str:
    return f"org-{uuid.uuid4().hex[:8]}"


def form_csrf(html: str) -> str:
    """The CSRF token of the first form on a page."""
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found is not None
    return found.group(1)


def over_https(client: TestClient) -> TestClient:
    """``client`` speaking https, as a browser behind TLS: the console's cookies are Secure,
    and a cookie jar sends a Secure cookie back over https only."""
    client.base_url = "https://testserver"
    return client


def login_form(client: TestClient) -> str:
    """Open the login form as a browser does (its nonce cookie lands in ``client``); the
    form's CSRF token."""
    form = client.get("/console/login")
    assert form.status_code == 200
    return form_csrf(form.text)


def logged_in(client: TestClient, token: str = ADMIN) -> str:
    """Log ``client`` in (over https); the session's CSRF token."""
    csrf = login_form(over_https(client))
    form = {"token": token, "csrf": csrf}
    answer = client.post("/console/login", data=form, follow_redirects=False)
    assert answer.status_code == 303, answer.text
    assert answer.headers["location"] == "/console/overview"
    page = client.get("/console/overview")
    assert page.status_code == 200
    return form_csrf(page.text)


def use_cookie(client: TestClient, value: str) -> TestClient:
    """``client`` with this session cookie value only."""
    client.cookies.clear()
    client.cookies.set(sessions.COOKIE, value)
    return client


def text_of(html: str) -> str:
    return unescape(re.sub(r"<[^>]+>", " ", html))


def sent_to_login(answer: Response) -> bool:
    return (answer.status_code, answer.headers.get("location")) == (303, "/console/login")


def cookie_value(header: str) -> str:
    """The value a Set-Cookie header sets."""
    return header.split(";", maxsplit=1)[0].partition("=")[2]


def cookie_attributes(header: str) -> dict[str, str]:
    """A Set-Cookie header's attributes (Secure, Path, ...), by lower-case name."""
    pairs = [part.strip().partition("=") for part in header.split(";")[1:]]
    return {name.lower(): value for name, _, value in pairs}


def digest_forms(token: str) -> list[str]:
    """The SHA-256 of ``token`` as hex and as base64 (standard and URL-safe, with and
    without padding): what a cookie must not hold."""
    digest = hashlib.sha256(token.encode()).digest()
    forms = [digest.hex()]
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        text = encode(digest).decode()
        forms += [text, text.rstrip("=")]
    return forms


def readable(value: str) -> str:
    """A cookie value as it is, and each of its dot-separated parts base64-decoded."""
    found = [value]
    for part in value.split("."):
        with contextlib.suppress(ValueError):
            found.append(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)).decode())
    return "\n".join(found)


def test_pages_need_a_session_and_the_login_takes_the_admin_token_only(
    make_client: ClientFactory,
) -> None:
    client = over_https(make_client())
    for path in ("/console/overview", "/console/items", "/console/pools", "/console/costs"):
        answer = client.get(path, follow_redirects=False)
        assert (answer.status_code, answer.headers["location"]) == (303, "/console/login"), path
    csrf = login_form(client)
    form = {"token": "wrong", "csrf": csrf}
    refused = client.post("/console/login", data=form, follow_redirects=False)
    assert refused.status_code == 401 and "not accepted" in refused.text
    assert "wrong" not in refused.text and sessions.COOKIE not in refused.cookies
    assert form_csrf(refused.text) == csrf  # the form again, for the same browser

    form = {"token": ADMIN, "csrf": csrf}
    answer = client.post("/console/login", data=form, follow_redirects=False)
    assert answer.status_code == 303
    assert client.get("/console/overview").status_code == 200


def login_over_http(client: TestClient) -> tuple[str, list[str]]:
    """Log ``client`` in as the admin over plain http, handing the login form's nonce back
    by hand (a cookie jar keeps a Secure cookie for https); the Set-Cookie headers of the
    form and of the login."""
    form = client.get("/console/login")
    [login_cookie] = form.headers.get_list("set-cookie")
    answer = client.post(
        "/console/login",
        data={"token": ADMIN, "csrf": form_csrf(form.text)},
        headers={"Cookie": f"{sessions.LOGIN_COOKIE}={cookie_value(login_cookie)}"},
        follow_redirects=False,
    )
    assert answer.status_code == 303, answer.text
    return login_cookie, answer.headers.get_list("set-cookie")


def test_the_session_cookie_is_secure_over_plain_http_and_holds_only_a_random_id(
    make_client: ClientFactory, pg_db: Database
) -> None:
    # Plain http, no forwarded header: what the api sees behind a TLS proxy it does not trust.
    login_cookie, headers = login_over_http(make_client())
    [session_cookie] = [h for h in headers if h.startswith(f"{sessions.COOKIE}=")]
    for header, path in ((session_cookie, "/console"), (login_cookie, "/console/login")):
        attributes = cookie_attributes(header)
        assert {"secure", "httponly"} <= set(attributes), header
        assert (attributes["samesite"].lower(), attributes["path"]) == ("strict", path)
    value = cookie_value(session_cookie)
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}", value)  # 32 random bytes
    for form_of_token in [ADMIN, *digest_forms(ADMIN)]:
        assert form_of_token not in " ".join(headers), "the token's digest in a cookie"
        assert form_of_token not in readable(value), "the token's digest in the cookie"
    # The table keeps the id's SHA-256, never the id.
    with pg_db.session() as session:
        row = session.get_one(ConsoleSessionRecord, hash_token(value))
        assert value not in repr([getattr(row, c.key) for c in ConsoleSessionRecord.__table__.c])
        assert (row.api_key_id, row.org_id, row.revoked_at) == (None, None, None)


def test_the_insecure_cookie_setting_drops_secure_and_nothing_else(
    make_client: ClientFactory,
) -> None:
    for insecure in (False, True):  # the default, then plain-http development
        client = make_client(console_insecure_cookie=insecure)
        _, headers = login_over_http(client)
        [session_cookie] = [h for h in headers if h.startswith(f"{sessions.COOKIE}=")]
        attributes = cookie_attributes(session_cookie)
        assert ("secure" in attributes) is not insecure and "httponly" in attributes
        assert (attributes["samesite"].lower(), attributes["path"]) == ("strict", "/console")
    assert client.get("/console/overview").status_code == 200  # sent back over http


def test_the_login_form_needs_its_own_csrf_token(make_client: ClientFactory) -> None:
    client = over_https(make_client())
    csrf = login_form(client)
    assert client.cookies[sessions.LOGIN_COOKIE] != csrf  # the form holds the nonce's HMAC
    theirs = login_form(over_https(make_client()))  # another browser's form
    for form in ({}, {"csrf": ""}, {"csrf": "x" + csrf}, {"csrf": theirs}):
        refused = client.post("/console/login", data={"token": ADMIN, **form})
        assert refused.status_code == 403, form
        assert "login form token" in text_of(refused.text)
        assert sessions.COOKIE not in refused.cookies
    # The right token without the browser's nonce cookie: a post from another site's page.
    refused = over_https(make_client()).post("/console/login", data={"token": ADMIN, "csrf": csrf})
    assert refused.status_code == 403 and "reload the login page" in text_of(refused.text)
    answer = client.post(
        "/console/login", data={"token": ADMIN, "csrf": csrf}, follow_redirects=False
    )
    assert answer.status_code == 303
    assert sessions.LOGIN_COOKIE not in client.cookies  # used: the next login gets a new one


def test_a_forged_or_tampered_cookie_is_no_session(make_client: ClientFactory) -> None:
    client = make_client()
    logged_in(client)
    value = client.cookies[sessions.COOKIE]
    flipped = value[:-1] + ("A" if value[-1] != "A" else "B")
    for forged in (flipped, hash_token(value), value + "A", "garbage", ""):
        use_cookie(client, forged)
        assert sent_to_login(client.get("/console/items", follow_redirects=False)), forged
    use_cookie(client, value)
    assert client.get("/console/items", follow_redirects=False).status_code == 200


def test_a_changed_admin_token_ends_the_session(make_client: ClientFactory) -> None:
    client = make_client()
    logged_in(client)
    value = client.cookies[sessions.COOKIE]
    # Another api process of the deployment takes it ...
    assert use_cookie(make_client(), value).get("/console/items").status_code == 200
    # ... until the admin token changes.
    rt = runtime.current()
    settings = rt.settings.model_copy(update={"admin_token": SecretStr("another-admin-token")})
    runtime.install(runtime.Runtime(settings=settings, db=rt.db))
    assert client.get("/console/items", follow_redirects=False).status_code == 303


def test_logging_out_revokes_the_session_server_side(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    csrf = logged_in(client)
    value = client.cookies[sessions.COOKIE]
    copy = use_cookie(make_client(), value)  # the cookie, copied before the logout
    assert copy.get("/console/items").status_code == 200
    logout = client.post("/console/logout", data={"csrf": csrf}, follow_redirects=False)
    assert sent_to_login(logout)
    assert sessions.COOKIE not in client.cookies
    assert sent_to_login(copy.get("/console/items", follow_redirects=False))
    again = copy.post("/console/logout", data={"csrf": csrf}, follow_redirects=False)
    assert sent_to_login(again)
    with pg_db.session() as session:
        assert session.get_one(ConsoleSessionRecord, hash_token(value)).revoked_at is not None


def test_a_revoked_or_deleted_org_key_ends_its_console_sessions(
    make_client: ClientFactory, pg_db: Database
) -> None:
    mine = org()
    with pg_db.session() as session:
        revoked_id, revoked = create_key(session, mine, "console", ["read"])
        deleted_id, deleted = create_key(session, mine, "console", ["read"])
    clients = []
    for key in (revoked, deleted):
        clients.append(make_client())
        logged_in(clients[-1], key)
        assert clients[-1].get("/console/items").status_code == 200
    with pg_db.session() as session:
        rows = session.scalars(
            select(ConsoleSessionRecord).where(ConsoleSessionRecord.org_id == mine)
        ).all()
        assert sorted(row.api_key_id or "" for row in rows) == sorted([revoked_id, deleted_id])
        assert revoke_key(session, mine, revoked_id)
        session.execute(delete(ApiKey).where(ApiKey.id == deleted_id))
    for client in clients:
        assert sent_to_login(client.get("/console/items", follow_redirects=False))


def test_every_answer_says_nosniff(make_client: ClientFactory) -> None:
    client = make_client()
    answers = {
        "login page": client.get("/console/login"),
        "json": client.get("/v1/admin/pools", headers=admin_headers()),
        "json 404": client.get("/v1/work-items/wi-none", headers=admin_headers()),
        "no such route": client.get("/v1/no-such-route"),
        "401": client.get("/v1/admin/pools"),
        "static file": client.get("/console/static/htmx.min.js"),
        "redirect": client.get("/console/overview", follow_redirects=False),
    }
    logged_in(client)
    answers["page"] = client.get("/console/overview")
    answers["console 404"] = client.get("/console/items/wi-none")
    statuses = {name: answer.status_code for name, answer in answers.items()}
    assert statuses == {
        "login page": 200,
        "json": 200,
        "json 404": 404,
        "no such route": 404,
        "401": 401,
        "static file": 200,
        "redirect": 303,
        "page": 200,
        "console 404": 404,
    }
    for name, answer in answers.items():
        assert answer.headers.get_list("x-content-type-options") == ["nosniff"], name
        assert answer.headers.get_list("referrer-policy") == ["no-referrer"], name
        assert answer.headers.get_list("x-frame-options") == ["DENY"], name


def test_state_changes_need_the_csrf_nonce(make_client: ClientFactory, pg_db: Database) -> None:
    client = make_client()
    csrf = logged_in(client)
    item_id, _ = awaiting_item(pg_db, org())
    refused = client.post(f"/console/items/{item_id}/cancel", data={})
    assert refused.status_code == 403
    refused = client.post(f"/console/items/{item_id}/cancel", data={"csrf": "x" + csrf})
    assert refused.status_code == 403
    with pg_db.session() as session:
        assert session.get(WorkItem, item_id).state == "awaiting_claim"  # type: ignore[union-attr]
    done = client.post(
        f"/console/items/{item_id}/cancel", headers={"X-CSRF-Token": csrf}, follow_redirects=False
    )
    assert done.status_code == 303
    with pg_db.session() as session:
        assert session.get(WorkItem, item_id).state == "cancelled"  # type: ignore[union-attr]
    logout = client.post("/console/logout", data={"csrf": csrf}, follow_redirects=False)
    assert logout.status_code == 303
    assert client.get("/console/items", follow_redirects=False).status_code == 303


def test_the_item_page_shows_events_sandbox_and_log_and_the_log_follows(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    logged_in(client)
    item_id, token = awaiting_item(pg_db, org())
    with pg_db.session() as session:
        session.add(WorkItemLog(work_item_id=item_id, stream="stdout", line="first <line>"))
    page = client.get(f"/console/items/{item_id}")
    assert page.status_code == 200
    text = text_of(page.text)
    assert "awaiting_claim" in text and "first <line>" in text and "first <line>" not in page.text
    with pg_db.session() as session:
        events = session.scalars(
            select(LifecycleEvent.to_state).where(LifecycleEvent.work_item_id == item_id)
        ).all()
        last = session.scalar(select(WorkItemLog.id).where(WorkItemLog.work_item_id == item_id))
    timeline = re.search(r'<ol class="timeline" id="events">(.*?)</ol>', page.text, re.S)
    assert timeline is not None
    assert re.findall(r'<b class="to">([a-z_]+)</b>', timeline.group(1)) == list(events)
    assert f'hx-get="/console/items/{item_id}/logs?after={last}"' in page.text
    assert token not in page.text and "crt_" not in page.text

    with pg_db.session() as session:
        session.add(WorkItemLog(work_item_id=item_id, stream="stderr", line="second"))
    more = client.get(f"/console/items/{item_id}/logs?after={last}")
    assert 'hx-swap-oob="beforeend:#log-lines"' in more.text
    assert "second" in more.text and "first" not in more.text
    assert client.get("/console/items/wi-nope").status_code == 404
    for query in ("state=asleep", "after=noon", "since=soon"):
        refused = client.get(f"/console/items?{query}")
        assert refused.status_code == 422 and query.split("=")[0] in text_of(refused.text), query


def test_the_item_page_shows_each_attempt_s_end_log_escaped(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    logged_in(client)
    item_id, _ = awaiting_item(pg_db, org())
    kept = "starting\n<script>alert(1)</script> cannot start"
    with pg_db.session() as session:
        sandbox = session.scalars(select(Sandbox).where(Sandbox.work_item_id == item_id)).one()
        sandbox.end_log = kept
        attempt = sandbox.attempt
    page = client.get(f"/console/items/{item_id}")
    shown = re.search(
        rf'<pre class="log end-log" id="end-log-{attempt}">(.*?)</pre>', page.text, re.S
    )
    assert shown is not None and unescape(shown.group(1)) == kept
    assert "<script>alert(1)" not in page.text


def test_overview_numbers_are_the_databases(make_client: ClientFactory, pg_db: Database) -> None:
    client = make_client()
    logged_in(client)
    awaiting_item(pg_db, org())
    while True:  # the page's and this test's hour are the same five-minute buckets
        hour = queries.last_hour()
        page = client.get("/console/overview").text
        with pg_db.session() as session:
            rows = session.execute(select(WorkItem.state, WorkItem.created_at)).all()
        if queries.last_hour() == hour:
            break
    states = [state for state, _ in rows]
    for state in set(states):
        shown = re.search(rf'id="state-{state}">(\d+)<', page)
        assert shown is not None and int(shown.group(1)) == states.count(state), state
    dispatched = re.search(r'id="dispatched-hour">(\d+)<', page)
    recent = [at for _, at in rows if at >= hour.start]
    assert dispatched is not None and int(dispatched.group(1)) == len(recent) > 0
    assert '<svg class="chart" id="rate"' in page
    assert re.search(r'id="in-flight-local">(\d+)<', page) is None  # its sandbox is ready


def test_an_org_login_sees_its_own_org_only(make_client: ClientFactory, pg_db: Database) -> None:
    mine, theirs = org(), org()
    with pg_db.session() as session:
        key_id, key = create_key(session, mine, "console", ["read"])
    client = make_client()
    csrf = logged_in(client, key)
    own, _ = awaiting_item(pg_db, mine)
    other, _ = awaiting_item(pg_db, theirs)
    listing = client.get("/console/items").text
    assert own in listing and other not in listing
    assert client.get(f"/console/items?org={theirs}").status_code == 404
    assert client.get(f"/console/items/{other}").status_code == 404
    assert client.get(f"/console/items/{own}").status_code == 200
    pools = client.get("/console/pools").text
    assert mine in pools and theirs not in pools
    # Read scope only: no cancelling (no button either), no provider settings.
    assert 'id="cancel"' not in client.get(f"/console/items/{own}").text
    refused = client.post(f"/console/items/{own}/cancel", data={"csrf": csrf})
    assert refused.status_code == 403
    refused = client.post("/console/providers/local/config", data={"csrf": csrf})
    assert refused.status_code == 403
    for owner in (mine, theirs):
        stored = client.put(
            f"/v1/admin/orgs/{owner}/credentials/local",
            json={"secret": "s3cr3t"},
            headers=admin_headers(),
        )
        assert stored.status_code == 200, stored.text
    provider = client.get("/console/providers/local").text
    assert 'id="config-form"' not in provider and 'id="credential-form"' not in provider
    assert f'id="credential-{mine}"' in provider and theirs not in provider
    # A revoked key ends the session at the next request.
    with pg_db.session() as session:
        assert revoke_key(session, mine, key_id)
    assert client.get("/console/items", follow_redirects=False).status_code == 303


def test_a_pool_is_disabled_enabled_and_edited_with_validation(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    csrf = logged_in(client)
    item_id, _ = awaiting_item(pg_db, org())
    with pg_db.session() as session:
        pool_id = session.get(WorkItem, item_id).pool_id  # type: ignore[union-attr]
    for active in ("false", "true"):
        answer = client.post(
            f"/console/pools/{pool_id}/active", data={"csrf": csrf, "active": active}
        )
        assert answer.status_code == 200
        assert ("disabled" if active == "false" else "enabled") in text_of(answer.text)
        with pg_db.session() as session:
            assert session.get(Pool, pool_id).active is (active == "true")  # type: ignore[union-attr]
    page = client.get(f"/console/pools/{pool_id}").text
    assert 'id="pool-capabilities"' in page and "enforces allowed hosts" in page
    form = {"csrf": csrf, "priority": "7", "max_concurrent": "3", "f.command": "/bin/true"}
    assert client.post(f"/console/pools/{pool_id}", data=form).status_code == 200
    with pg_db.session() as session:
        pool = session.get(Pool, pool_id)
        assert pool is not None
        assert (pool.priority, pool.max_concurrent) == (7, 3)
        assert pool.sandbox_config == {"command": ["/bin/true"]}
    bad = client.post(f"/console/pools/{pool_id}", data={**form, "max_concurrent": "-1"})
    assert bad.status_code == 422 and "max_concurrent" in text_of(bad.text)
    assert 'name="max_concurrent" value="-1"' in bad.text  # what was submitted, to correct
    bad = client.post(f"/console/pools/{pool_id}", data={**form, "capabilities": "{nope"})
    assert bad.status_code == 422 and "capabilities: not valid JSON" in text_of(bad.text)


def test_the_provider_form_saves_validates_and_tests_the_connection(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client()
    csrf = logged_in(client)
    page = client.get("/console/providers/local").text
    assert 'name="f.grace_period_s"' in page and 'name="f.isolation"' in page
    bad = client.post(
        "/console/providers/local/config", data={"csrf": csrf, "f.grace_period_s": "soon"}
    )
    assert bad.status_code == 422
    assert "grace_period_s" in text_of(bad.text) and 'value="soon"' in bad.text
    try:  # the shared database: forget the stored settings whatever happens
        saved = client.post(
            "/console/providers/local/config",
            data={"csrf": csrf, "f.grace_period_s": "2.5", "f.isolation": "off"},
        )
        assert saved.status_code == 200 and 'id="saved"' in saved.text
        config = client.get("/v1/admin/providers/local/config", headers=admin_headers())
        assert config.json()["source"] == "stored"
        assert config.json()["config"]["grace_period_s"] == 2.5
        checked = client.post("/console/providers/local/check", data={"csrf": csrf, "org": ""})
        assert checked.status_code == 200 and "healthy" in checked.text
        assert 'id="forget-config"' in saved.text
    finally:
        forgotten = client.post("/console/providers/local/config/forget", data={"csrf": csrf})
    assert forgotten.status_code == 200 and 'id="config-source">default<' in forgotten.text
    assert 'id="forget-config"' not in forgotten.text


def test_an_org_credential_is_stored_write_only_and_forgotten(
    make_client: ClientFactory,
) -> None:
    client = make_client()
    csrf = logged_in(client)
    owner, secret = org(), f"credential-{uuid.uuid4().hex}"
    stored = client.post(
        "/console/providers/local/credentials",
        data={"csrf": csrf, "org": owner, "secret": secret},
    )
    assert stored.status_code == 200 and f'id="credential-{owner}"' in stored.text
    assert secret not in stored.text
    listed = client.get(f"/v1/admin/orgs/{owner}/credentials", headers=admin_headers())
    assert [c["provider"] for c in listed.json()["credentials"]] == ["local"]
    refused = client.post(
        "/console/providers/local/credentials", data={"csrf": csrf, "org": "", "secret": "x"}
    )
    assert refused.status_code == 422 and "org" in text_of(refused.text)
    forgotten = client.post(
        "/console/providers/local/credentials/forget", data={"csrf": csrf, "org": owner}
    )
    assert forgotten.status_code == 200 and f'id="credential-{owner}"' not in forgotten.text


def test_secrets_are_set_listed_and_deleted_and_their_values_never_shown(
    make_client: ClientFactory, pg_db: Database
) -> None:
    client = make_client(secret_key=TEST_SECRET_KEY)
    csrf = logged_in(client)
    owner, value, shared = org(), f"value-{uuid.uuid4().hex}", f"shared-{uuid.uuid4().hex}"
    name = f"dep-{uuid.uuid4().hex[:8]}"
    form = {"csrf": csrf, "org": owner, "scope": "org", "name": "api-token", "value": value}
    pages = [client.post("/console/secrets", data=form)]
    deployment = {**form, "scope": "deployment", "name": name, "value": shared}
    pages.append(client.post("/console/secrets", data={**deployment, "shown_org": owner}))
    pages.append(client.get(f"/console/secrets?org={owner}"))
    assert pages[-1].status_code == 200
    assert 'id="org-secrets-api-token"' in pages[-1].text
    assert f'id="deployment-secrets-{name}"' in pages[-1].text
    assert secrets.resolve_secret(pg_db, owner, "api-token") == value
    assert secrets.resolve_secret(pg_db, "any-org", name) == shared
    refused = client.post("/console/secrets", data={**form, "name": "bad name"})
    assert refused.status_code == 422 and "name" in text_of(refused.text)
    pages.append(refused)
    stale = client.post("/console/secrets", data={**form, "csrf": "stale"})
    assert stale.status_code == 403
    gone = client.post(
        "/console/secrets/delete", data={"csrf": csrf, "org": owner, "name": "api-token"}
    )
    pages.append(client.get(f"/console/secrets?org={owner}"))
    assert gone.status_code == 200 and 'id="org-secrets-api-token"' not in pages[-1].text
    # The form's shown_org comes back as one query value, never more of the URL.
    hostile = {**deployment, "shown_org": "x&org=y#z"}
    back = client.post("/console/secrets", data=hostile, headers={"hx-request": "true"})
    assert back.headers["HX-Redirect"] == "/console/secrets?org=x%26org%3Dy%23z"
    client.post("/console/secrets/delete", data={**deployment, "value": ""})
    assert not any(value in p.text or shared in p.text for p in pages)

    # An org's admin login manages its own org's secrets, not the deployment's.
    with pg_db.session() as session:
        _, key = create_key(session, owner, "console", ["read", "admin"])
    org_client = make_client(secret_key=TEST_SECRET_KEY)
    org_csrf = logged_in(org_client, key)
    listed = org_client.get("/console/secrets")
    assert listed.status_code == 200 and "Deployment-wide" not in listed.text
    own = {"csrf": org_csrf, "scope": "org", "name": "mine", "value": value}
    assert org_client.post("/console/secrets", data=own).status_code == 200
    assert secrets.resolve_secret(pg_db, owner, "mine") == value
    theirs = {**own, "scope": "deployment"}
    assert org_client.post("/console/secrets", data=theirs).status_code == 403


def test_costs_page_and_csv(make_client: ClientFactory) -> None:
    client = make_client()
    logged_in(client)
    page = client.get("/console/costs?since=24h&by=provider")
    assert page.status_code == 200 and 'id="cost-total"' in page.text
    csv = client.get("/console/costs.csv?since=24h&by=provider")
    assert csv.status_code == 200 and csv.headers["content-type"].startswith("text/csv")
    assert csv.text.splitlines()[0] == "bucket_start,provider,events,seconds,amount_micros,amount"
    for query in ("since=yesterday", "by=color"):
        refused = client.get(f"/console/costs?{query}")
        assert refused.status_code == 422 and query.split("=")[0] in text_of(refused.text)


def test_static_files_ship_and_no_page_links_outside(make_client: ClientFactory) -> None:
    client = make_client()
    logged_in(client)
    assert client.get("/console/static/htmx.min.js").status_code == 200
    assert client.get("/console/static/../session.py").status_code == 404
    for path in ("/console/overview", "/console/items", "/console/providers", "/console/costs"):
        page = client.get(path).text
        assert "http://" not in page and "https://" not in page, path


def test_a_read_key_cannot_run_a_provider_check_the_api_refuses_it(
    make_client: ClientFactory, pg_db: Database
) -> None:
    mine = org()
    with pg_db.session() as session:
        _, key = create_key(session, mine, "console", ["read"])
    client = make_client()
    api = client.post("/v1/admin/providers/local/check", headers={"Authorization": f"Bearer {key}"})
    csrf = logged_in(client, key)
    console = client.post("/console/providers/local/check", data={"csrf": csrf, "org": ""})
    assert api.status_code == console.status_code == 403


# -- every console route with an org login, aimed at another org ------------------------


def _their_objects(client: TestClient, db: Database, theirs: str) -> dict[str, str]:
    """An item of ``theirs`` with its sandbox billed, its pool and a stored credential."""
    item_id, _ = awaiting_item(db, theirs)
    with db.session() as session:
        sandbox = session.scalars(select(Sandbox).where(Sandbox.work_item_id == item_id)).one()
        now = datetime.now(UTC)
        session.add(
            CostEvent(
                sandbox_id=sandbox.id,
                work_item_id=item_id,
                org_id=theirs,
                project_id="web",
                pool_id=sandbox.pool_id,
                provider_id="local",
                started_at=now - timedelta(minutes=1),
                ended_at=now,
                seconds=60.0,
                billing_model="per_second",
                amount_micros=123,
            )
        )
        pool_id = sandbox.pool_id
    stored = client.put(
        f"/v1/admin/orgs/{theirs}/credentials/local",
        json={"secret": "their-s3cr3t"},
        headers=admin_headers(),
    )
    assert stored.status_code == 200, stored.text
    with db.session() as session:
        hook, _ = webhooks.create_endpoint(
            session,
            Keyring(TEST_SECRET_KEY),
            theirs,
            "https://example.com/theirs",
            ["item.final"],
            allow_http=False,
        )
    secrets.set_secret(db, theirs, "their-secret", "their-secret-value")
    target = webhooks.event_target(hook["id"], "item.final", now.isoformat())
    tried = OutboxRow(0, item_id, theirs, "webhook", target, 0, now)
    webhook_log.record_try(db, tried, webhook_log.Try(500, None, now))
    return {"item": item_id, "pool": pool_id, "webhook": hook["id"], "event": target["event_id"]}


def _console_walk(
    theirs: str, item: str, pool: str, webhook: str, event: str
) -> list[tuple[str, str, dict[str, str]]]:
    """Every console route, aimed at ``theirs`` where it takes an org, item, pool, webhook
    or event."""
    mine_only = {"org": theirs}
    hook = {**mine_only, "url": "https://example.com/mine", "event.item.final": "on"}
    return [
        ("GET", f"/console/webhooks?org={theirs}", {}),
        ("POST", "/console/webhooks", hook),
        ("GET", f"/console/webhooks/{webhook}", {}),
        ("POST", f"/console/webhooks/{webhook}/remove", {}),
        ("POST", f"/console/webhooks/events/{event}/redeliver", {}),
        ("POST", f"/console/webhooks/events/{event}/redeliver", mine_only),
        ("GET", f"/console/secrets?org={theirs}", {}),
        ("POST", "/console/secrets", {**mine_only, "name": "their-secret", "value": "mine"}),
        ("POST", "/console/secrets", {"scope": "deployment", "name": "x", "value": "mine"}),
        ("POST", "/console/secrets/delete", {**mine_only, "name": "their-secret"}),
        ("POST", "/console/secrets/delete", {"scope": "deployment", "name": "their-secret"}),
        ("GET", "/console", {}),
        ("GET", "/console/overview", {}),
        ("GET", f"/console/items?org={theirs}", {}),
        ("GET", "/console/items", {}),
        ("GET", f"/console/items/{item}", {}),
        ("GET", f"/console/items/{item}/bundle", {}),
        ("GET", f"/console/items/{item}/logs", {}),
        ("POST", f"/console/items/{item}/cancel", {}),
        ("POST", f"/console/items/{item}/bundle/accept", {"sha256": "0" * 64}),
        ("POST", f"/console/items/{item}/bundle/reject", {"sha256": "0" * 64}),
        ("GET", "/console/pools", {}),
        ("GET", f"/console/pools/{pool}", {}),
        ("POST", f"/console/pools/{pool}", {"priority": "9", "max_concurrent": "1"}),
        ("POST", f"/console/pools/{pool}/active", {"active": "false"}),
        ("GET", f"/console/pools/{pool}/delete", {}),
        ("POST", f"/console/pools/{pool}/delete", {}),
        ("GET", "/console/capacities", {}),
        ("POST", "/console/capacities", {"name": "mine", "slots": "100"}),
        ("POST", "/console/capacities/cap-x", {"slots": "100"}),
        ("POST", "/console/capacities/cap-x/delete", {}),
        ("POST", "/console/weights", {**mine_only, "weight": "5"}),
        ("GET", "/console/providers", {}),
        ("GET", "/console/providers/local", {}),
        ("POST", "/console/providers/local/check", mine_only),
        ("POST", "/console/providers/local/config", {}),
        ("POST", "/console/providers/local/config/forget", {}),
        ("POST", "/console/providers/local/credentials", {**mine_only, "secret": "mine"}),
        ("POST", "/console/providers/local/credentials/forget", mine_only),
        ("GET", f"/console/costs?org={theirs}&since=24h", {}),
        ("GET", "/console/costs?since=24h&by=org", {}),
        ("GET", f"/console/costs.csv?org={theirs}&since=24h", {}),
        ("GET", "/console/costs.csv?since=24h&by=org", {}),
    ]


def test_an_org_admin_login_reaches_nothing_of_another_org_on_any_console_route(
    make_client: ClientFactory, pg_db: Database
) -> None:
    mine, theirs = org(), org()
    with pg_db.session() as session:
        _, key = create_key(session, mine, "console", ["read", "dispatch", "admin"])
    client = make_client()
    victim = _their_objects(client, pg_db, theirs)
    csrf = logged_in(client, key)
    walk = _console_walk(theirs, *(victim[k] for k in ("item", "pool", "webhook", "event")))
    for method, path, form in walk:
        answer = client.request(
            method, path, data={"csrf": csrf, **form} if method == "POST" else None
        )
        assert answer.status_code in (200, 303, 403, 404), (path, answer.status_code)
        for secret in (theirs, *victim.values(), "their-s3cr3t", "their-secret-value"):
            assert secret not in answer.text, (path, secret)
    with pg_db.session() as session:
        pool = session.get_one(Pool, victim["pool"])
        assert (pool.active, pool.priority, pool.deleted_at) == (True, 0, None)
        assert session.get_one(WorkItem, victim["item"]).state == "awaiting_claim"
        assert session.get_one(WebhookEndpoint, victim["webhook"]).disabled_at is None
        owed = select(OutcomeOutbox).where(OutcomeOutbox.org_id.in_([mine, theirs]))
        assert session.scalars(owed).all() == [], "no event of theirs owed again"
        hooks = select(WebhookEndpoint.id).where(WebhookEndpoint.org_id == theirs)
        assert session.scalars(hooks).all() == [victim["webhook"]], "no endpoint made"
    assert secrets.resolve_secret(pg_db, theirs, "their-secret") == "their-secret-value"
    stored = queries.credential_orgs(runtime.current().db, "local", None)
    assert theirs in {credential["org"] for credential in stored}, "their credential kept"
    # Every console route is in the walk (a new one must be added to it).
    routes = api_routes(client.app.routes)  # type: ignore[attr-defined]
    walked = {(method, path.split("?")[0]) for method, path, _ in walk}
    ids = {victim["item"]: "{item_id}", victim["pool"]: "{pool_id}", "local": "{provider_id}"}
    ids |= {victim["webhook"]: "{webhook_id}", victim["event"]: "{event_id}"}
    ids |= {"cap-x": "{capacity_id}"}
    for value, name in ids.items():
        walked = {(m, p.replace(f"/{value}", f"/{name}")) for m, p in walked}
    open_routes = {("GET", "/console/login"), ("POST", "/console/login")}
    open_routes |= {("POST", "/console/logout"), ("GET", "/console/static/{name}")}
    console = {(m, r.path) for r in routes if r.path.startswith("/console") for m in r.methods}
    assert (
        sorted(console - {(m, p) for m, p in console if m == "HEAD"} - walked - open_routes) == []
    )


def test_a_dispatch_key_login_cancels_its_orgs_item_from_its_page(
    make_client: ClientFactory, pg_db: Database
) -> None:
    # The api lets a dispatch key cancel; so does the console, button and all.
    mine = org()
    with pg_db.session() as session:
        _, key = create_key(session, mine, "console", ["dispatch"])
    client = make_client()
    csrf = logged_in(client, key)
    own, _ = awaiting_item(pg_db, mine)
    assert 'id="cancel"' in client.get(f"/console/items/{own}").text
    done = client.post(f"/console/items/{own}/cancel", data={"csrf": csrf}, follow_redirects=False)
    assert done.status_code == 303, done.text
    with pg_db.session() as session:
        assert session.get_one(WorkItem, own).state == "cancelled"
    assert 'id="cancel"' not in client.get(f"/console/items/{own}").text  # final: no button


# A review form as the item page renders it: its decision and the digest it names.
REVIEW_FORM = re.compile(
    r'action="/console/items/[^/"]+/bundle/(accept|reject)"[^>]*>\s*'
    r'<input type="hidden" name="csrf" value="[^"]+">\s*'
    r'<input type="hidden" name="sha256" value="([0-9a-f]{64})">'
)


def test_a_review_login_decides_on_the_bundle_its_page_showed(
    make_client: ClientFactory, pg_db: Database
) -> None:
    mine = org()
    with pg_db.session() as session:
        _, reviewer = create_key(session, mine, "console", ["review"])
        _, dispatcher = create_key(session, mine, "console", ["dispatch"])
    client = make_client()
    item_id, headers = running(client, pg_db, mine, review={"required": True})
    first, second = bundle({"a.txt": b"reviewed\n"}), bundle({"a.txt": b"slipped in\n"})
    client.put("/v1/runner/bundle", content=first, headers=GZIP | headers)
    seen_first = downloaded_sha256(client, item_id)
    client.put("/v1/runner/bundle", content=second, headers=GZIP | headers)
    client.post("/v1/runner/complete", json={"exit_code": 0}, headers=headers)
    path = f"/console/items/{item_id}"
    second_sha256 = hashlib.sha256(second).hexdigest()
    # A dispatch login sees no review form, and may not post one.
    csrf = logged_in(client, dispatcher)
    assert REVIEW_FORM.findall(client.get(path).text) == []
    form = {"csrf": csrf, "sha256": second_sha256}
    refused = client.post(f"{path}/bundle/accept", data=form, follow_redirects=False)
    assert refused.status_code == 403
    # A review login's page names the bundle it shows in each form.
    csrf = logged_in(client, reviewer)
    shown = client.get(path).text
    assert REVIEW_FORM.findall(shown) == [("accept", second_sha256), ("reject", second_sha256)]
    assert second_sha256 in text_of(shown)
    # A form naming the bundle that was replaced (a page rendered before) is refused.
    stale = {"csrf": csrf, "sha256": seen_first}
    old = client.post(f"{path}/bundle/accept", data=stale, follow_redirects=False)
    assert old.status_code == 409 and "download it again" in text_of(old.text)
    assert view_review(client, item_id) == "review_requested"
    done = client.post(f"{path}/bundle/accept", data=form | {"csrf": csrf}, follow_redirects=False)
    assert done.status_code == 303, done.text
    assert view_review(client, item_id) == "accepted"
    assert REVIEW_FORM.findall(client.get(path).text) == []  # decided: no form


def view_review(client: TestClient, item_id: str) -> str:
    shown = client.get(f"/v1/work-items/{item_id}", headers=admin_headers()).json()
    return str(shown["bundle"]["review"])


def test_a_pool_whose_stored_override_does_not_parse_is_shown_with_why_and_breaks_no_page(
    make_client: ClientFactory, pg_db: Database
) -> None:
    # Written around the admin api (which refuses it) or by an older version: the overview,
    # the pools list and the pool's page still answer, and say what is wrong with it.
    client = make_client()
    logged_in(client)
    item_id, _ = awaiting_item(pg_db, org())
    with pg_db.session() as session:
        pool = session.get(Pool, session.get(WorkItem, item_id).pool_id)  # type: ignore[union-attr]
        assert pool is not None
        pool_id, pool.runtime_provides = pool.id, {"runtimes": ["python"]}
    try:
        for path in ("/console/overview", "/console/pools", f"/console/pools/{pool_id}"):
            answer = client.get(path)
            assert answer.status_code == 200, (path, answer.text[-500:])
            row = re.search(rf'<tr id="pool-{pool_id}">.*?</tr>', answer.text, re.S)
            shown = row.group(0) if row else answer.text
            assert "runtimes: unknown key, expected runtimeKinds" in text_of(shown), path
    finally:
        with pg_db.session() as session:
            pool = session.get(Pool, pool_id)
            assert pool is not None
            pool.runtime_provides = None
