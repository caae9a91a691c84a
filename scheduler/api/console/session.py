"""The console's browser session: a login form takes a token once, and an HttpOnly,
SameSite=Strict cookie carries a signed session from then on.

The cookie never holds the token. It holds the SHA-256 digest of the token presented, the
session's expiry and its CSRF nonce, signed with HMAC-SHA256 under a key derived from
``CORRAL_SECRET_KEY`` (else from the admin token). Every request checks the signature and
the expiry, then finds the caller again by the digest (:func:`principal_for_digest`): a
changed admin token, or a revoked org key, ends its sessions at once.

Every state-changing form carries the session's CSRF nonce (a hidden ``csrf`` field, or the
``X-CSRF-Token`` header htmx sends), checked against the cookie's.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

from fastapi import HTTPException, Request, Response

from corral.scheduler.api.auth import DEPLOYMENT_ADMIN, Principal, Scope, identify
from corral.scheduler.api.process_runtime import ApiRuntime
from corral.shared.runtime import Runtime
from corral.shared.store.api_keys import find_key_by_hash
from corral.shared.store.tokens import hash_token

COOKIE = "corral_console"
SESSION_TTL_S = 8 * 3600
CSRF_HEADER = "x-csrf-token"
_KEY_LABEL = b"corral-console-session-v1"


class LoginRequired(Exception):  # noqa: N818 - a redirect, not an error
    """No valid session: the page answers with a redirect to the login form."""


@dataclass(frozen=True)
class ConsoleSession:
    principal: Principal
    csrf: str
    expires_at: int


def _signing_key(rt: Runtime) -> bytes | None:
    settings = rt.settings
    material = settings.secret_key or settings.admin_token
    if material is None:
        return None
    return hmac.new(material.get_secret_value().encode(), _KEY_LABEL, hashlib.sha256).digest()


def _admin_digest(rt: Runtime) -> str | None:
    token = rt.settings.admin_token
    return hash_token(token.get_secret_value()) if token is not None else None


def org_key_principal(rt: Runtime, token_digest: str) -> Principal | None:
    """The org key whose SHA-256 is ``token_digest``, as a caller; None once revoked."""
    with rt.db.session() as session:
        key = find_key_by_hash(session, token_digest)
    if key is None:
        return None
    return Principal(scopes=frozenset(Scope(s) for s in key.scopes), org_id=key.org_id)


def principal_for_digest(rt: Runtime, token_digest: str) -> Principal | None:
    """The caller whose token has this digest now, or None (changed, revoked, unknown)."""
    admin = _admin_digest(rt)
    if admin is not None and hmac.compare_digest(admin, token_digest):
        return DEPLOYMENT_ADMIN
    return org_key_principal(rt, token_digest)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def seal(rt: Runtime, token_digest: str, *, now: float | None = None) -> str:
    """A new session's cookie value for the caller with this token digest."""
    key = _signing_key(rt)
    if key is None:
        raise HTTPException(status_code=503, detail="the console needs CORRAL_ADMIN_TOKEN")
    expires = int((now or time.time()) + SESSION_TTL_S)
    payload = json.dumps(
        {"d": token_digest, "x": expires, "c": secrets.token_urlsafe(24)}, separators=(",", ":")
    ).encode()
    signature = hmac.new(key, payload, hashlib.sha256).digest()
    return f"{_b64(payload)}.{_b64(signature)}"


def open_session(
    rt: Runtime, value: str | None, *, now: float | None = None
) -> ConsoleSession | None:
    """The session a cookie value carries, or None: unsigned, expired, or its caller gone."""
    key = _signing_key(rt)
    if not value or key is None or value.count(".") != 1:
        return None
    encoded, signature = value.split(".")
    try:
        payload, given = _unb64(encoded), _unb64(signature)
    except ValueError:
        return None
    if not hmac.compare_digest(hmac.new(key, payload, hashlib.sha256).digest(), given):
        return None
    fields = json.loads(payload)
    if fields["x"] < (now or time.time()):
        return None
    principal = principal_for_digest(rt, fields["d"])
    if principal is None or Scope.READ not in principal.scopes:
        return None
    return ConsoleSession(principal=principal, csrf=fields["c"], expires_at=fields["x"])


def login(rt: Runtime, token: str) -> str | None:
    """A session cookie value for ``token``, or None when it may not use the console
    (unknown, a runner session, or no read scope)."""
    if not token:
        return None
    try:
        principal = identify(rt, f"Bearer {token}")
    except HTTPException:
        return None
    if principal.runner_item is not None or Scope.READ not in principal.scopes:
        return None
    token_digest = hash_token(token)
    if principal_for_digest(rt, token_digest) is None:
        return None
    return seal(rt, token_digest)


def set_cookie(response: Response, request: Request, value: str) -> None:
    response.set_cookie(
        COOKIE,
        value,
        max_age=SESSION_TTL_S,
        path="/console",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def clear_cookie(response: Response) -> None:
    response.delete_cookie(COOKIE, path="/console", httponly=True, samesite="strict")


def current(request: Request, rt: ApiRuntime) -> ConsoleSession:
    """A FastAPI dependency: the request's session, else a redirect to the login form."""
    session = open_session(rt, request.cookies.get(COOKIE))
    if session is None:
        raise LoginRequired
    return session


def check_csrf(session: ConsoleSession, request: Request, form: dict[str, str]) -> None:
    """Refuse (403) a state-changing request without the session's CSRF nonce."""
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
