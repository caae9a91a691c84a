"""The console's browser session: a login form takes a token once; from then on a cookie
carries a random session id, and the session itself is a row in the database
(corral.shared.store.console_sessions).

The cookie holds nothing derived from the token: a copy of it is worth the session only,
until the session ends (8 hours after the login, or at logout, which revokes the row). It
is ``HttpOnly``, ``SameSite=Strict``, ``Path=/console`` and ``Secure`` whatever the
request's scheme, unless ``CORRAL_CONSOLE_INSECURE_COOKIE`` says otherwise (plain-http
development). Each request finds the session's row again, with its org key: a revoked or
deleted key, or a changed admin token, ends its sessions at once.

CSRF: every state-changing form carries the session's token (a hidden ``csrf`` field, or
the ``X-CSRF-Token`` header htmx sends), an HMAC of a fixed label keyed by the session id,
which a page may show without giving the id away. The login form, before any session,
carries a signed double-submit token: a random nonce in a cookie of its own
(:data:`LOGIN_COOKIE`, ``Path=/console/login``) and, in the form, the nonce's HMAC under a
key derived from ``CORRAL_SECRET_KEY`` (else the admin token), checked one against the
other, so that no other site can log a browser in under a token of its choosing.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime

from fastapi import HTTPException, Request, Response

from corral.scheduler.api.auth import DEPLOYMENT_ADMIN, Principal, Scope, identify
from corral.scheduler.api.process_runtime import ApiRuntime
from corral.shared.runtime import Runtime
from corral.shared.store.api_keys import find_key
from corral.shared.store.console_sessions import (
    SESSION_TTL,
    LiveSession,
    find_session,
    revoke_session,
    start_session,
)
from corral.shared.store.db import utcnow
from corral.shared.text import IDENTIFIER

COOKIE = "corral_console"
LOGIN_COOKIE = "corral_console_login"
PATH = "/console"
LOGIN_PATH = "/console/login"
SESSION_TTL_S = int(SESSION_TTL.total_seconds())
CSRF_HEADER = "x-csrf-token"
# What secrets.token_urlsafe(32) makes; any other cookie value is no session and no nonce.
_TOKEN_SHAPE = re.compile(r"[A-Za-z0-9_-]{43}")
_CSRF_LABEL = b"corral-console-csrf-v1"
_LOGIN_KEY_LABEL = b"corral-console-login-v1"


class LoginRequired(Exception):  # noqa: N818 - a redirect, not an error
    """No valid session: the page answers with a redirect to the login form."""


@dataclass(frozen=True)
class ConsoleSession:
    principal: Principal
    csrf: str
    expires_at: datetime


def _admin_token(rt: Runtime) -> str | None:
    token = rt.settings.admin_token
    return token.get_secret_value() if token is not None else None


def _principal(live: LiveSession) -> Principal:
    if live.key is None:
        return DEPLOYMENT_ADMIN
    return Principal(scopes=frozenset(Scope(s) for s in live.key.scopes), org_id=live.key.org_id)


def _csrf_token(session_id: str) -> str:
    return hmac.new(session_id.encode(), _CSRF_LABEL, hashlib.sha256).hexdigest()


def open_session(
    rt: Runtime, value: str | None, *, now: datetime | None = None
) -> ConsoleSession | None:
    """The live session a cookie value names, or None (unknown, expired, logged out, or its
    caller gone)."""
    if value is None or not _TOKEN_SHAPE.fullmatch(value):
        return None
    with rt.db.session() as session:
        live = find_session(session, value, admin_token=_admin_token(rt), now=now or utcnow())
    if live is None:
        return None
    principal = _principal(live)
    if Scope.READ not in principal.scopes:
        return None
    return ConsoleSession(principal=principal, csrf=_csrf_token(value), expires_at=live.expires_at)


def login(rt: Runtime, token: str) -> str | None:
    """A new session's id for ``token``, or None when it may not use the console (unknown,
    a runner session, or no read scope)."""
    if not token:
        return None
    try:
        principal = identify(rt, f"Bearer {token}")
    except HTTPException:
        return None
    if principal.runner_item is not None or Scope.READ not in principal.scopes:
        return None
    with rt.db.session() as session:
        if principal.is_deployment_admin:
            return start_session(session, key=None, admin_token=token, now=utcnow())
        key = find_key(session, token)
        if key is None:
            return None
        return start_session(session, key=key, admin_token=None, now=utcnow())


def logout(rt: Runtime, request: Request) -> None:
    """Revoke the request's session: its cookie, wherever a copy of it is, opens nothing."""
    value = request.cookies.get(COOKIE)
    if value is not None and _TOKEN_SHAPE.fullmatch(value):
        with rt.db.session() as session:
            revoke_session(session, value, now=utcnow())


def _set(
    response: Response, rt: Runtime, name: str, value: str, *, path: str, max_age: int | None
) -> None:
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        path=path,
        httponly=True,
        samesite="strict",
        secure=not rt.settings.console_insecure_cookie,
    )


def _clear(response: Response, rt: Runtime, name: str, path: str) -> None:
    secure = not rt.settings.console_insecure_cookie
    response.delete_cookie(name, path=path, secure=secure, httponly=True, samesite="strict")


def set_cookie(response: Response, rt: Runtime, session_id: str) -> None:
    _set(response, rt, COOKIE, session_id, path=PATH, max_age=SESSION_TTL_S)


def clear_cookie(response: Response, rt: Runtime) -> None:
    _clear(response, rt, COOKIE, PATH)


def current(request: Request, rt: ApiRuntime) -> ConsoleSession:
    """A FastAPI dependency: the request's session, else a redirect to the login form."""
    session = open_session(rt, request.cookies.get(COOKIE))
    if session is None:
        raise LoginRequired
    return session


def check_csrf(session: ConsoleSession, request: Request, form: dict[str, str]) -> None:
    """Refuse (403) a state-changing request without the session's CSRF token."""
    given = request.headers.get(CSRF_HEADER) or form.get("csrf") or ""
    if not hmac.compare_digest(given.encode(), session.csrf.encode()):
        raise HTTPException(status_code=403, detail="missing or stale CSRF token: reload the page")


def require(session: ConsoleSession, scope: Scope, org_id: str | None = None) -> None:
    """403 unless the caller holds ``scope`` (over ``org_id``'s rows when given)."""
    allowed = scope in session.principal.scopes
    if org_id is not None:
        allowed = allowed and session.principal.sees(org_id)
    if not allowed:
        raise HTTPException(status_code=403, detail="not allowed for this login")


def admin_org(session: ConsoleSession, org: str | None) -> str | None:
    """The org an admin page is about: an org key's own (another answers 404), or the one
    the deployment admin named (None: none yet); the caller must hold the admin scope over
    it."""
    chosen = session.principal.org_filter((org or "").strip() or None)
    if chosen is not None and re.fullmatch(IDENTIFIER, chosen) is None:
        raise HTTPException(status_code=422, detail="org: an org id (letters, digits, - _ .)")
    require(session, Scope.ADMIN, chosen)
    return chosen


# -- the login form's double-submit token ---------------------------------------------------


def login_nonce(request: Request) -> str:
    """The browser's login nonce (its cookie), or a new one."""
    held = request.cookies.get(LOGIN_COOKIE)
    return held if held and _TOKEN_SHAPE.fullmatch(held) else secrets.token_urlsafe(32)


def login_csrf(rt: Runtime, nonce: str) -> str:
    """The login form's token for ``nonce``: its HMAC under the console's login key."""
    settings = rt.settings
    material = settings.secret_key or settings.admin_token
    if material is None:
        raise HTTPException(status_code=503, detail="the console needs CORRAL_ADMIN_TOKEN")
    key = hmac.new(material.get_secret_value().encode(), _LOGIN_KEY_LABEL, hashlib.sha256)
    return hmac.new(key.digest(), nonce.encode(), hashlib.sha256).hexdigest()


def set_login_cookie(response: Response, rt: Runtime, nonce: str) -> None:
    _set(response, rt, LOGIN_COOKIE, nonce, path=LOGIN_PATH, max_age=None)  # till it closes


def clear_login_cookie(response: Response, rt: Runtime) -> None:
    _clear(response, rt, LOGIN_COOKIE, LOGIN_PATH)


def check_login_csrf(rt: Runtime, request: Request, form: dict[str, str]) -> None:
    """Refuse (403) a login whose form token is not the HMAC of the browser's nonce."""
    nonce = request.cookies.get(LOGIN_COOKIE)
    given = form.get("csrf", "")
    if nonce is None or not _TOKEN_SHAPE.fullmatch(nonce):
        raise HTTPException(status_code=403, detail="no login form token: reload the login page")
    if not hmac.compare_digest(given.encode(), login_csrf(rt, nonce).encode()):
        raise HTTPException(
            status_code=403, detail="missing or stale login form token: reload the login page"
        )
