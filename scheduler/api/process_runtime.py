"""The api's one way to its process's runtime: a FastAPI dependency that tests override.

Route handlers and dependencies take ``rt: ApiRuntime``; what runs outside a route (the
middleware, a request's JSON reading) asks :func:`runtime_of` with the app, which honours
the same override. Either way a test hands the api its runtime with
``app.dependency_overrides[get_runtime] = lambda: rt``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends

from corral.shared import runtime
from corral.shared.runtime import Runtime


async def get_runtime() -> Runtime:
    """The process's runtime (a FastAPI dependency; a coroutine, so that FastAPI does not
    hand it to a worker thread as it does every plain function)."""
    return runtime.current()


ApiRuntime = Annotated[Runtime, Depends(get_runtime)]


def runtime_of(app: Any) -> Runtime:
    """The runtime the routes of ``app`` (a FastAPI app) get: its override of
    :func:`get_runtime` (a plain function of no arguments), else the process's."""
    overrides = getattr(app, "dependency_overrides", None) or {}
    override = overrides.get(get_runtime)
    found: Runtime = runtime.current() if override is None else override()
    return found
