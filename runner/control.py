"""The control plane's runner API: JSON over HTTP, HTTPS, or HTTP over a Unix socket.

Sandboxes without network reach the control plane through a Unix socket mounted into them
(``unix:///path/to/api.sock``). Each call opens its own connection: calls come from three
threads (work, logs, heartbeat), are few, and a fresh connection needs no locking.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable

from .diagnostics import logger
from .errors import (
    ConfigurationError,
    ConflictError,
    ControlError,
    ProtocolError,
    ThrottledError,
    UnauthorizedError,
)
from .protocol import (
    Claim,
    Completion,
    Enrolment,
    Registration,
    parse_claim,
    parse_enrolment,
    parse_registration,
    parse_warm_wait,
)
from .records import field, record, replace
from .wire import MalformedResponseError, exchange

TYPE_CHECKING = False  # not typing's: see corral.runner.records
if TYPE_CHECKING:
    from typing import Any, BinaryIO

RUNNER_VERSION = "0.1.0"
_BODY_SNIPPET = 200
# A Retry-After longer than this is waited for this long only; a call spends at most
# ControlClient.throttle_budget_s waiting on 429s in all, then fails like any error.
MAX_RETRY_AFTER_S = 60.0
BUNDLE_PATH = "/v1/runner/bundle"


_UNIX_PREFIX = "unix://"


def _plain_unix(url: str) -> bool:
    """Whether ``url`` is ``unix:///abs/path`` with nothing ``urlsplit`` would read
    otherwise (no query, fragment, space or control character): its path is then all after
    ``unix://``, as ``urlsplit`` gives it."""
    return (
        url.startswith(_UNIX_PREFIX + "/")
        and not any(char in url for char in "?#")
        and all(" " < char != "\x7f" for char in url)
    )


@record
class Endpoint:
    """Where the control plane listens, parsed from ``CORRAL_CONTROL_URL``."""

    scheme: str
    host: str = ""
    port: int | None = None
    socket_path: str = ""
    base_path: str = ""

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        """Accept ``http://host:port[/prefix]``, ``https://...`` or ``unix:///abs/path``.

        Raises:
            ConfigurationError: another scheme, no host, or a relative socket path.
        """
        if _plain_unix(url):  # the common case, without urllib's import (4 ms a start)
            return cls(scheme="unix", socket_path=url.removeprefix(_UNIX_PREFIX))
        from urllib.parse import urlsplit  # noqa: PLC0415

        parts = urlsplit(url)
        if parts.scheme == "unix":
            if parts.netloc or not parts.path.startswith("/"):
                raise ConfigurationError(
                    f"control URL {url!r}: a unix URL needs an absolute path, unix:///abs/path"
                )
            return cls(scheme="unix", socket_path=parts.path)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigurationError(
                f"control URL {url!r}: expected http://host:port, https://host or unix:///path"
            )
        try:
            port = parts.port
        except ValueError as error:
            raise ConfigurationError(f"control URL {url!r}: {error}") from error
        return cls(
            scheme=parts.scheme,
            host=parts.hostname,
            port=port,
            base_path=parts.path.rstrip("/"),
        )

    @property
    def host_header(self) -> str:
        """The Host a request names: the host, with its port when one is given."""
        if self.scheme == "unix":
            return "localhost"  # only fills the header: the socket path is the address
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"

    def connect(self, timeout: float) -> socket.socket:
        """A new socket connected to this endpoint (TLS-wrapped for https).

        Raises:
            OSError: the endpoint could not be reached, or TLS failed.
        """
        if self.scheme == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(self.socket_path)
            except BaseException:
                sock.close()
                raise
            return sock
        default_port = 443 if self.scheme == "https" else 80
        sock = socket.create_connection((self.host, self.port or default_port), timeout)
        if self.scheme != "https":
            return sock
        # Imported here: an image whose Python lacks ssl can still use http and unix.
        import ssl  # noqa: PLC0415

        try:
            return ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise


@record
class ControlClient:
    """Calls the runner API; authorised with the session token once registered."""

    endpoint: Endpoint
    timeout_s: float = 10.0
    backoff_s: float = 0.2
    backoff_max_s: float = 5.0
    # How long register, claim and complete keep trying an unreachable or failing control
    # plane: an api restart or a database outage takes seconds to minutes, and the work a
    # runner did must still be reported.
    retry_budget_s: float = 600.0
    throttle_budget_s: float = 300.0
    session_token: str | None = field(default=None, repr=False)

    def with_session(self, session_token: str) -> ControlClient:
        """This client, sending ``Authorization: Bearer <session_token>`` from now on."""
        return replace(self, session_token=session_token)

    def register(self, token: str, *, claim: bool = False) -> Registration:
        """Trade the one-time registration token for a session; with ``claim``, claim the
        work item in the same call (the answer's claim: None when it must be asked apart).

        Raises:
            UnauthorizedError: the token is invalid, used or expired.
            ControlError: unreachable, or another error answer.
            ProtocolError: the answer is not a registration.
        """
        body: dict[str, Any] = {"token": token, "runner_version": RUNNER_VERSION}
        if claim:
            body["claim"] = True
        return parse_registration(self.post("/v1/runner/register", body, retry=True))

    def enrol(self, token: str) -> Enrolment:
        """A warm runner's first call: redeem its single-use enrolment credential for the
        channel it then waits on (docs/warm-pools.md).

        Raises:
            UnauthorizedError: the credential is invalid or used, or the warm sandbox ended.
            ControlError: unreachable, or another error answer.
            ProtocolError: the answer is not an enrolment.
        """
        body = {"token": token, "runner_version": RUNNER_VERSION}
        return parse_enrolment(self.post("/v1/runner/enrol", body, retry=True))

    def warm_wait(self) -> str | None:
        """One wait on the warm channel (this client's session is the channel token): the
        bound item's registration token, or None when the api held the call and nothing came.

        Raises:
            UnauthorizedError: the channel is closed (the warm sandbox ended).
            ControlError: unreachable past the retry budget, or another error answer.
            ProtocolError: not the answer's shape.
        """
        return parse_warm_wait(self.post("/v1/runner/warm/wait", {}, retry=True))

    def claim(self) -> Claim:
        """Take the work item this sandbox was started for.

        A lost answer is retried, so the control plane should hand a repeated claim from
        the same session the same work rather than a 409.

        Raises:
            ConflictError: another runner already claimed it.
            ControlError: unreachable, or another error answer.
            ProtocolError: the answer is not a work item the runner understands.
        """
        return parse_claim(self.post("/v1/runner/claim", {}, retry=True))

    def heartbeat(self) -> bool:
        """Report liveness; True when the control plane asks to cancel the work.

        Raises:
            UnauthorizedError: the session expired or was revoked.
            ControlError: unreachable, or another error answer.
        """
        answer = self.post("/v1/runner/heartbeat", {})
        return isinstance(answer, dict) and answer.get("cancel") is True

    def send_logs(self, lines: list[dict[str, Any]]) -> Any:
        """Post one batch of log lines; the answer, ``{"accepted": n, "dropped": m}`` (lines
        past the work item's log budget are dropped by the control plane).

        Raises:
            ControlError: unreachable, or an error answer.
        """
        return self.post("/v1/runner/logs", {"lines": lines})

    def complete(self, completion: Completion, lines: list[dict[str, Any]] | None = None) -> None:
        """Report how the work phase ended, with the work's last log ``lines`` (at most one
        batch: they are kept as ``/logs`` keeps them, once). The control plane takes a
        repeated report of an item it already finished as done, so a lost answer is safe
        to retry.

        Raises:
            ControlError: unreachable, or an error answer.
        """
        body = completion.to_json()
        if lines:
            body["lines"] = lines
        self.post("/v1/runner/complete", body, retry=True)

    def upload_bundle(self, archive: str) -> Any:
        """PUT the result bundle at ``archive`` (a gzipped tar), streamed from the file; a
        repeated upload replaces the first, so a lost answer is safe to retry.

        Raises:
            ControlError: unreachable, or an error answer (413: over the api's limit).
        """
        size = os.path.getsize(archive)

        def once() -> Any:
            with open(archive, "rb") as body:
                return self._send_once(BUNDLE_PATH, body, "application/gzip", size, "PUT")

        return self._with_retries(once, retry=True)

    def post(self, path: str, body: Any, *, retry: bool = False) -> Any:
        """POST ``body`` as JSON and return the decoded answer (None when empty).

        With ``retry``, unreachable and 5xx are retried for up to ``retry_budget_s`` with
        pauses doubling up to ``backoff_max_s`` (or the answer's Retry-After): the api may
        be restarting, or its database away. 429 (too many calls) waits its Retry-After and
        tries again, for up to ``throttle_budget_s`` in all. Another 4xx is never retried.

        Raises:
            UnauthorizedError: 401.
            ConflictError: 409.
            ThrottledError: still 429 after ``throttle_budget_s`` of waiting.
            ControlError: still unreachable when the budget ran out, or another error answer.
            ProtocolError: a success answer that is not JSON.
        """
        data = json.dumps(body).encode("utf-8")
        return self._with_retries(
            lambda: self._send_once(path, data, "application/json", len(data)), retry=retry
        )

    def _with_retries(self, once: Callable[[], Any], *, retry: bool) -> Any:
        delay, attempt, throttled_s = self.backoff_s, 1, 0.0
        give_up_at = time.monotonic() + (self.retry_budget_s if retry else 0.0)
        while True:
            try:
                return once()
            except ThrottledError as error:
                pause = _pause(error, delay)
                if throttled_s + pause > self.throttle_budget_s:
                    raise
                throttled_s += pause
                logger.info("%s; waiting %.1f s", error, pause)
            except ControlError as error:
                pause = _pause(error, delay)
                if not error.retryable or time.monotonic() + pause > give_up_at:
                    raise
                logger.warning("%s (attempt %d); retrying in %.1f s", error, attempt, pause)
                attempt += 1
                delay = min(delay * 2, self.backoff_max_s)
            time.sleep(pause)

    def _send_once(
        self, path: str, body: bytes | BinaryIO, content_type: str, size: int, method: str = "POST"
    ) -> Any:
        headers = {
            "Host": self.endpoint.host_header,
            "Content-Type": content_type,
            "Content-Length": str(size),
            "Accept": "application/json",
            "Accept-Encoding": "identity",
            "User-Agent": f"corral-runner/{RUNNER_VERSION}",
        }
        if self.session_token is not None:
            headers["Authorization"] = f"Bearer {self.session_token}"
        call = f"{method} {path}"
        try:
            with self.endpoint.connect(self.timeout_s) as sock:
                answer = exchange(sock, method, self.endpoint.base_path + path, headers, body)
        except (OSError, MalformedResponseError) as error:
            raise ControlError(f"{call}: {type(error).__name__}: {error}") from error
        retry_after = _seconds(answer.header("Retry-After"))
        return _decode(call, answer.status, answer.body, retry_after)


def _seconds(value: str | None) -> float | None:
    """A Retry-After in seconds (the HTTP-date form is not used by corral's api)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < float("inf") else None


def _pause(error: ControlError, backoff_s: float) -> float:
    wanted = error.retry_after_s if error.retry_after_s is not None else backoff_s
    return min(wanted, MAX_RETRY_AFTER_S)


def _decode(call: str, status: int, data: bytes, retry_after: float | None = None) -> Any:
    """The JSON of a 2xx answer, or the exception an error answer stands for; ``call`` is
    the method and path, e.g. ``POST /v1/runner/claim``."""
    if 200 <= status < 300:
        if not data.strip():
            return None
        try:
            return json.loads(data)
        except ValueError as error:
            raise ProtocolError(f"{call}: the answer is not JSON: {error}") from error
    snippet = data[:_BODY_SNIPPET].decode("utf-8", errors="replace")
    message = f"{call} answered {status}: {snippet}"
    if status == 401:
        raise UnauthorizedError(message, status=status)
    if status == 409:
        raise ConflictError(message, status=status)
    if status == 429:
        raise ThrottledError(message, status=status, retry_after_s=retry_after)
    raise ControlError(message, status=status, retry_after_s=retry_after)
