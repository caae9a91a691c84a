"""What every request passes before it reaches the state: the request log, failures a test
injected, and bearer-token authentication and namespace authorization.

Kept out of the HTTP layer so that tests drive it from their own thread through plain methods,
under a lock of its own, while the server thread consults it."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from tests.standins.kubernetes_api import ApiError, ResourceType, forbidden, injected, unauthorized


@dataclass
class RecordedRequest:
    """One request as the server saw it; the Authorization header is left out on purpose so a
    test can search the log for secrets without tripping over the cluster token."""

    method: str
    path: str
    query: str
    body: bytes
    headers: dict[str, str]
    status: int = 0

    @property
    def params(self) -> dict[str, list[str]]:
        return parse_qs(self.query, keep_blank_values=True)

    @property
    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    def contains(self, needle: str) -> bool:
        """Whether ``needle`` appears anywhere the client put data: path, query, headers, body."""
        haystack = [
            self.path,
            self.query,
            self.body.decode(errors="replace"),
            *self.headers.values(),
        ]
        if any(needle in text for text in haystack):
            return True
        return needle in json.dumps(self.params)


@dataclass
class FailureRule:
    """Answer the next ``remaining`` matching requests with ``status`` after ``delay`` seconds
    (``status`` None: only delay, then serve normally). With a ``rate`` below 1, each matching
    request is picked with that probability (drawn from ``rng``); the others pass untouched.
    ``statuses``: each failure answers one of them instead, drawn from ``rng``. ``served``:
    the probability that a failure is answered only after the request was served (made,
    deleted, changed), its answer lost, as a gateway that gave up on a slow API server."""

    status: int | None
    remaining: int
    delay: float = 0.0
    method: str | None = None
    path_prefix: str | None = None
    retry_after: int | None = None
    message: str | None = None
    rate: float = 1.0
    rng: random.Random = field(default_factory=random.Random, repr=False)
    statuses: tuple[int, ...] = ()
    served: float = 0.0

    def failure(self) -> ApiError | None:
        """The error a matching request gets (None: only delayed)."""
        status = self.rng.choice(self.statuses) if self.statuses else self.status
        return None if status is None else injected(status, self.message, self.retry_after)

    def after_serving(self) -> bool:
        return self.served >= 1 or (self.served > 0 and self.rng.random() < self.served)

    def matches(self, method: str, path: str) -> bool:
        if self.method is not None and self.method.upper() != method.upper():
            return False
        if self.path_prefix is not None and not path.startswith(self.path_prefix):
            return False
        return self.rate >= 1 or self.rng.random() < self.rate


@dataclass
class Identity:
    user: str
    namespaces: frozenset[str] | None  # None: every namespace


@dataclass
class Gate:
    """Request log, failure injection and authentication, shared across threads."""

    stopping: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _log: list[RecordedRequest] = field(default_factory=list)
    _rules: list[FailureRule] = field(default_factory=list)
    _tokens: dict[str, Identity] = field(default_factory=dict)

    def add_token(self, token: str, user: str, namespaces: frozenset[str] | None = None) -> None:
        with self._lock:
            self._tokens[token] = Identity(user, namespaces)

    def record(
        self, method: str, path: str, query: str, body: bytes, headers: dict[str, str]
    ) -> RecordedRequest:
        kept = {key: value for key, value in headers.items() if key.lower() != "authorization"}
        entry = RecordedRequest(method, path, query, body, kept)
        with self._lock:
            self._log.append(entry)
        return entry

    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._log)

    def clear_requests(self) -> None:
        with self._lock:
            self._log.clear()

    def add_rule(self, rule: FailureRule) -> None:
        with self._lock:
            self._rules.append(rule)

    def clear_rules(self) -> None:
        with self._lock:
            self._rules.clear()

    def pending_rules(self) -> int:
        with self._lock:
            return sum(rule.remaining for rule in self._rules)

    def _take_rule(self, method: str, path: str) -> FailureRule | None:
        with self._lock:
            for rule in self._rules:
                if rule.remaining > 0 and rule.matches(method, path):
                    rule.remaining -= 1
                    if rule.remaining == 0:
                        self._rules.remove(rule)
                    return rule
        return None

    async def apply_failures(self, method: str, path: str) -> ApiError | None:
        """Sleep and/or raise what the first matching rule says; a failure to answer after
        the request was served is returned instead, for the caller to raise then. The sleep
        gives up when the stand-in stops, so a hanging request never holds up shutdown."""
        rule = self._take_rule(method, path)
        if rule is None:
            return None
        deadline = time.monotonic() + rule.delay
        while time.monotonic() < deadline and not self.stopping.is_set():
            await asyncio.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
        with self._lock:  # the rule's rng is shared by the server's requests
            error, later = rule.failure(), rule.after_serving()
        if error is not None and not later:
            raise error
        return error

    def authenticate(self, authorization: str | None) -> Identity:
        scheme, _, token = (authorization or "").partition(" ")
        with self._lock:
            identity = self._tokens.get(token) if scheme.lower() == "bearer" else None
        if identity is None:
            raise unauthorized()
        return identity

    @staticmethod
    def authorize(
        identity: Identity,
        rt: ResourceType,
        verb: str,
        namespace: str | None,
        name: str | None,
        *,
        subresource: str | None = None,
    ) -> None:
        """A token limited to some namespaces gets RBAC's 403 everywhere else."""
        if identity.namespaces is None:
            return
        if namespace is None or namespace not in identity.namespaces:
            raise forbidden(rt, verb, namespace or "", identity.user, name, subresource=subresource)


__all__ = ["ApiError", "FailureRule", "Gate", "Identity", "RecordedRequest"]
