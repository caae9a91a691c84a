"""Who is calling the api, and what they may do.

Every route asks for a :class:`Principal` with the scope it needs (``needs(Scope.READ)``
and so on). The deployment admin token (``CORRAL_ADMIN_TOKEN``) is a principal of every
scope over every org (``org_id`` None); an org key (``cok_``, corral.shared.store.api_keys) holds
its scopes over its own org only; a runner session may read its own work item and nothing
else. A route that reads or changes an org's rows checks ``principal.sees(org)`` and answers
404 when it may not, the same as for a row that does not exist; what only the deployment
may change (model profiles, provider configuration) answers 403 to an org key.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

from fastapi import Header, HTTPException

from corral.scheduler.api.http_errors import ServiceUnavailable
from corral.scheduler.api.key_cache import KeyCache
from corral.scheduler.api.process_runtime import ApiRuntime
from corral.scheduler.api.runner_api import bearer
from corral.shared.runtime import Runtime
from corral.shared.store.api_keys import KEY_PREFIX, FoundKey, find_key_by_hash
from corral.shared.store.tokens import find_runner_session, hash_token


class Scope(StrEnum):
    DISPATCH = "dispatch"
    READ = "read"
    REVIEW = "review"  # accepting and rejecting result bundles; dispatch does not hold it
    ADMIN = "admin"


EVERY_SCOPE = frozenset(Scope)


@dataclass(frozen=True)
class Principal:
    """A caller: the deployment admin (``org_id`` None), an org key, or a runner session."""

    scopes: frozenset[Scope]
    org_id: str | None = None
    runner_item: str | None = None  # the one work item a runner session may read

    @property
    def is_deployment_admin(self) -> bool:
        return self.org_id is None and self.runner_item is None

    def sees(self, org_id: str | None) -> bool:
        """Whether this caller may see a row of ``org_id``."""
        return self.is_deployment_admin or (org_id is not None and org_id == self.org_id)

    def org_filter(self, requested: str | None) -> str | None:
        """The org a listing is limited to: the caller's own, whatever was asked."""
        if self.runner_item is not None:  # a runner session lists nothing
            raise HTTPException(status_code=401, detail="unauthorized")
        if self.org_id is None:
            return requested
        if requested not in (None, self.org_id):
            raise HTTPException(status_code=404, detail="org not found")
        return self.org_id


def check_org(org_id: str, caller: Principal) -> None:
    """Answer 404 unless ``caller`` may act on ``org_id``'s rows (the same answer as for an
    org that does not exist)."""
    if not caller.sees(org_id):
        raise HTTPException(status_code=404, detail="org not found")


DEPLOYMENT_ADMIN = Principal(scopes=EVERY_SCOPE)
DEPLOYMENT_ONLY = "only the deployment admin token may do this; an org key may not"


def identify(rt: Runtime, authorization: str | None) -> Principal:
    """The caller behind an ``Authorization`` header; 401 for anything unknown."""
    token = bearer(authorization)
    settings = rt.settings
    known = _known(rt, token)
    if known is not None:
        return known
    if token is not None and token.startswith(KEY_PREFIX):
        key = org_key(rt, token)
        if key is not None:
            return _org_principal(key)
    elif token is not None:
        with rt.db.session() as session:
            found = find_runner_session(session, token)
        if found is not None:
            return Principal(scopes=frozenset(), runner_item=found.work_item_id)
    if settings.admin_token is None:
        raise ServiceUnavailable(
            "admin_disabled", "admin endpoints are disabled: set CORRAL_ADMIN_TOKEN"
        )
    raise HTTPException(status_code=401, detail="unauthorized")


async def identify_without_blocking(rt: Runtime, authorization: str | None) -> Principal:
    """:func:`identify` for a dependency on the event loop: a caller known without a read
    (the admin token, an org key the process keeps) at once, any other in a worker thread."""
    known = _known(rt, bearer(authorization))
    if known is not None:
        return known
    return await asyncio.to_thread(identify, rt, authorization)


def _known(rt: Runtime, token: str | None) -> Principal | None:
    """The caller ``token`` is when no read is needed to tell: the admin token, or an org
    key the process keeps; None when it takes one (or is no one)."""
    if token is None:
        return None
    admin = rt.settings.admin_token
    if admin is not None and hmac.compare_digest(token.encode(), admin.get_secret_value().encode()):
        return DEPLOYMENT_ADMIN
    if token.startswith(KEY_PREFIX):
        key = key_cache(rt).kept(hash_token(token))
        return None if key is None else _org_principal(key)
    return None


def _org_principal(key: FoundKey) -> Principal:
    return Principal(scopes=frozenset(Scope(s) for s in key.scopes), org_id=key.org_id)


def org_key(rt: Runtime, token: str) -> FoundKey | None:
    """The live org key ``token`` is (kept by the process for a few seconds:
    :mod:`corral.scheduler.api.key_cache`), or None."""

    def read(digest: str) -> FoundKey | None:
        with rt.db.session() as session:
            return find_key_by_hash(session, digest)

    return key_cache(rt).find(hash_token(token), read)


def key_cache(rt: Runtime) -> KeyCache:
    """The process's kept org keys."""
    return rt.part("org key cache", lambda rt: KeyCache(ttl_s=rt.settings.api_key_cache_ttl_s))


def needs(scope: Scope) -> Callable[..., Awaitable[Principal]]:
    """A FastAPI dependency: the caller, who must hold ``scope`` (401 otherwise)."""

    async def dependency(
        rt: ApiRuntime, authorization: Annotated[str | None, Header()] = None
    ) -> Principal:
        return await caller_holding(scope, rt, authorization)

    dependency.__name__ = f"needs_{scope.value}"
    return dependency


async def caller_holding(scope: Scope, rt: Runtime, authorization: str | None) -> Principal:
    """The caller behind ``authorization``, who must hold ``scope``: what :func:`needs`
    answers, for a route that reads its own headers."""
    caller = await identify_without_blocking(rt, authorization)
    if scope not in caller.scopes:
        if caller.org_id is not None:  # an org key without the scope
            raise HTTPException(status_code=403, detail=f"this key lacks the {scope} scope")
        raise HTTPException(status_code=401, detail="unauthorized")
    return caller


async def deployment_admin(
    rt: ApiRuntime, authorization: Annotated[str | None, Header()] = None
) -> Principal:
    """A FastAPI dependency: the deployment admin token only (403 for an org key)."""
    caller = await identify_without_blocking(rt, authorization)
    if caller.runner_item is not None or (Scope.ADMIN not in caller.scopes and not caller.org_id):
        raise HTTPException(status_code=401, detail="unauthorized")
    if not caller.is_deployment_admin:
        raise HTTPException(status_code=403, detail=DEPLOYMENT_ONLY)
    return caller


async def any_caller(
    rt: ApiRuntime, authorization: Annotated[str | None, Header()] = None
) -> Principal:
    """A FastAPI dependency: any known caller, a runner session included."""
    return await identify_without_blocking(rt, authorization)
