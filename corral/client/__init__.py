"""corral's Python clients: work items (:class:`Client`, :class:`AsyncClient`;
docs/dispatch.md) and interactive sessions (:class:`Session`, :class:`AsyncSession`;
docs/sessions.md).

Both write each call once, as a generator of steps (:mod:`corral.client.steps`), and send
it with httpx, blocking or awaited. Every exception they raise derives from
:class:`ClientError`. Importing this loads no web framework: only httpx and pydantic, and
the api's answer models.
"""

from corral.client.calls import Dispatched, ItemFilters, Retry
from corral.client.errors import (
    ApiError,
    ApiUnreachableError,
    BundleDigestError,
    ClientConfigError,
    ClientError,
    ConflictError,
    ForbiddenError,
    InvalidRequestError,
    NotFoundError,
    Problem,
    UnauthorizedError,
    UnavailableError,
    UnexpectedAnswerError,
    WaitTimeoutError,
)
from corral.client.items import AsyncClient, Client
from corral.client.sessions import (
    AsyncSession,
    ExecResult,
    Session,
    SessionEndedError,
    SessionError,
)
from corral.client.target import Target, find_target
from corral.scheduler.admin.responses import (
    BundleReviewed,
    Cancelled,
    LifecycleEventView,
    LogLineView,
    WorkItemRow,
    WorkItemView,
)
from corral.shared.messages import DispatchRequest
from corral.shared.store.kinds import ItemState

__all__ = [
    "ApiError",
    "ApiUnreachableError",
    "AsyncClient",
    "AsyncSession",
    "BundleDigestError",
    "BundleReviewed",
    "Cancelled",
    "Client",
    "ClientConfigError",
    "ClientError",
    "ConflictError",
    "DispatchRequest",
    "Dispatched",
    "ExecResult",
    "ForbiddenError",
    "InvalidRequestError",
    "ItemFilters",
    "ItemState",
    "LifecycleEventView",
    "LogLineView",
    "NotFoundError",
    "Problem",
    "Retry",
    "Session",
    "SessionEndedError",
    "SessionError",
    "Target",
    "UnauthorizedError",
    "UnavailableError",
    "UnexpectedAnswerError",
    "WaitTimeoutError",
    "WorkItemRow",
    "WorkItemView",
    "find_target",
]
