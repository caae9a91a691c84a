"""A protocol-level stand-in for Aliyun AgentRun's data API, for testing corral's agentrun
provider on loopback.

The provider talks to AgentRun only through the official ``agentrun-sdk``; this serves what
that SDK's data-plane calls send (``agentrun.sandbox.api``: ``SandboxDataAPI`` and
``CodeInterpreterDataAPI``), on a free 127.0.0.1 port, plain http:

* ``POST /sandboxes`` (create from a template, optionally with a ``sandboxId``),
  ``GET /sandboxes/{id}``, ``DELETE /sandboxes/{id}``: ``{"code": "SUCCESS", "requestId",
  "data": <sandbox>}``, the sandbox in the API's camelCase fields (``sandboxId``,
  ``templateName``, ``status``, ``createdAt``, ``sandboxIdleTimeoutSeconds``...), as the SDK's
  ``Sandbox`` model reads them;
* ``GET /sandboxes/{id}/health``: ``{"status": "ok"}``;
* ``POST /sandboxes/{id}/contexts`` (``{"id", "cwd", "language"}``), ``DELETE
  /sandboxes/{id}/contexts/{context}``;
* ``POST /sandboxes/{id}/contexts/execute``: the code really runs in a local Python
  subprocess with the request's ``timeout`` (at most the 30 s hard limit); the answer is
  ``{"contextId", "results": [{"type": "stdout"|"stderr", "text"}, {"type":
  "endOfExecution", "status"}]}``. Past the limit the process is killed and the answer is a
  500 whose error code says ``ExecutionTimeout``.

Errors are the API's: HTTP status and ``{"code", "message", "requestId"}``. Every request must
carry a valid ``Agentrun-Authorization`` (AGENTRUN4-HMAC-SHA256 over method, path, query and
the ``host``/``x-acs-*`` headers, checked by recomputing it with the SDK's own signer):
an unknown AccessKey id answers 401 ``InvalidAccessKeyId.NotFound``, a wrong signature 403
``SignatureDoesNotMatch``. A test can inject failures and delays (``fail_next``,
``delay_next``) and read back the sandboxes and requests.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

os.environ.setdefault("DISABLE_BREAKING_CHANGES_WARNING", "1")

from agentrun.utils.ram_signature import get_agentrun_signed_headers

HARD_TIMEOUT_S = 30.0
ACCESS_KEY_ID = "LTAIstandin0000000000"
ACCESS_KEY_SECRET = "standin-secret-0000000000000000"
ACCOUNT_ID = "1234567890123456"
TEMPLATE = "corral-code-interpreter"
_AUTH = re.compile(
    r"^AGENTRUN4-HMAC-SHA256 Credential=(?P<key>[^/]+)/(?P<date>\d{8})/(?P<region>[^/]+)/"
    r"agentrun/aliyun_v4_request,SignedHeaders=(?P<signed>[^,]+),Signature=(?P<sig>[0-9a-f]+)$"
)


@dataclass
class Fault:
    """An answer to give instead of the real one: ``status`` with an error body."""

    status: int
    code: str
    message: str
    path_contains: str | None = None
    method: str | None = None
    times: int = 1


@dataclass
class Delay:
    seconds: float
    path_contains: str | None = None
    times: int = 1


@dataclass
class StandinSandbox:
    sandbox_id: str
    template_name: str
    idle_timeout_s: int | None
    created_at: str
    status: str = "READY"
    contexts: set[str] = field(default_factory=set)
    process: subprocess.Popen[str] | None = None
    executions: int = 0

    def as_api(self) -> dict[str, Any]:
        return {
            "sandboxId": self.sandbox_id,
            "sandboxArn": f"acs:agentrun:cn-hangzhou:{ACCOUNT_ID}:sandbox/{self.sandbox_id}",
            "templateName": self.template_name,
            "templateId": f"tpl-{self.template_name}",
            "status": self.status,
            "createdAt": self.created_at,
            "lastUpdatedAt": self.created_at,
            "sandboxIdleTimeoutSeconds": self.idle_timeout_s,
            "metadata": {},
        }


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    body: Any


class AgentRunStandin:
    """The stand-in server: ``with AgentRunStandin() as standin: standin.endpoint``."""

    def __init__(self, *, templates: tuple[str, ...] = (TEMPLATE,)) -> None:
        self.templates = set(templates)
        self.credentials = {ACCESS_KEY_ID: ACCESS_KEY_SECRET}
        self.sandboxes: dict[str, StandinSandbox] = {}
        self.deleted: list[str] = []
        self.requests: list[RecordedRequest] = []
        self.lock = threading.Lock()
        self._faults: list[Fault] = []
        self._delays: list[Delay] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        with self.lock:
            for box in self.sandboxes.values():
                if box.process is not None:
                    box.process.kill()
        self._server.shutdown()
        self._server.server_close()

    # -- steering ---------------------------------------------------------------------------

    def fail_next(
        self,
        status: int,
        *,
        code: str | None = None,
        message: str | None = None,
        path_contains: str | None = None,
        method: str | None = None,
        times: int = 1,
    ) -> None:
        """The next ``times`` matching requests answer ``status`` with an API error body."""
        defaults = {
            401: ("InvalidAccessKeyId.NotFound", "Specified access key is not found."),
            403: ("Forbidden.RAM", "The user is not authorized to operate on the resource."),
            429: ("Throttling", "Request was denied due to request throttling."),
            500: ("InternalError", "The request processing has failed due to some unknown error."),
            503: ("ServiceUnavailable", "The request has failed due to a temporary failure."),
        }
        default_code, default_message = defaults.get(status, ("Error", "request failed"))
        fault = Fault(
            status,
            code or default_code,
            message or default_message,
            path_contains,
            method,
            times,
        )
        with self.lock:
            self._faults.append(fault)

    def delay_next(
        self, seconds: float, *, path_contains: str | None = None, times: int = 1
    ) -> None:
        with self.lock:
            self._delays.append(Delay(seconds, path_contains, times))

    def executions(self) -> int:
        with self.lock:
            return sum(1 for r in self.requests if r.path.endswith("/contexts/execute"))

    def live(self) -> list[str]:
        with self.lock:
            return sorted(self.sandboxes)

    # -- serving (called from the handler's threads) ------------------------------------------

    def take_fault(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self._faults:
                if (fault.path_contains is None or fault.path_contains in path) and (
                    fault.method is None or fault.method == method
                ):
                    fault.times -= 1
                    if fault.times <= 0:
                        self._faults.remove(fault)
                    return fault
        return None

    def take_delay(self, path: str) -> float:
        with self.lock:
            for delay in self._delays:
                if delay.path_contains is None or delay.path_contains in path:
                    delay.times -= 1
                    if delay.times <= 0:
                        self._delays.remove(delay)
                    return delay.seconds
        return 0.0

    def check_signature(self, method: str, url: str, headers: Any) -> tuple[int, str, str] | None:
        """None when the request is signed by a known key; else the error to answer."""
        header = headers.get("Agentrun-Authorization") or ""
        matched = _AUTH.match(header)
        if matched is None:
            return 401, "MissingAuthorization", "The request has no valid Agentrun-Authorization."
        secret = self.credentials.get(matched["key"])
        if secret is None:
            return 401, "InvalidAccessKeyId.NotFound", "Specified access key is not found."
        signed_at = datetime.strptime(headers.get("x-acs-date", ""), "%Y-%m-%dT%H:%M:%SZ")
        expected = get_agentrun_signed_headers(
            url=url,
            method=method,
            access_key_id=matched["key"],
            access_key_secret=secret,
            security_token=headers.get("x-acs-security-token") or None,
            region=matched["region"],
            sign_time=signed_at.replace(tzinfo=UTC),
        )
        if expected["Agentrun-Authorization"] != header:
            return (
                403,
                "SignatureDoesNotMatch",
                "The request signature does not conform to Aliyun standards.",
            )
        return None

    def route(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        parts = [part for part in path.split("/") if part]
        if parts[:1] != ["sandboxes"]:
            return _error(404, "NotFound", f"no such path {path}")
        if method == "POST" and len(parts) == 1:
            return self._create(body or {})
        with self.lock:
            box = self.sandboxes.get(parts[1]) if len(parts) > 1 else None
        if box is None:
            return _error(404, "SandboxNotFound", f"sandbox {parts[1:2]} does not exist")
        return self._on_sandbox(box, method, parts[2:], body or {})

    def _on_sandbox(
        self, box: StandinSandbox, method: str, rest: list[str], body: dict[str, Any]
    ) -> tuple[int, Any]:
        answers = {
            ("GET", ""): lambda: (200, _success(box.as_api())),
            ("DELETE", ""): lambda: (200, _success(self._delete(box))),
            ("GET", "health"): lambda: (200, {"status": "ok"}),
            ("POST", "contexts"): lambda: self._new_context(box, body),
            ("POST", "contexts/execute"): lambda: self._execute(box, body),
        }
        answer = answers.get((method, "/".join(rest)))
        if answer is not None:
            return answer()
        if len(rest) == 2 and rest[0] == "contexts" and method == "DELETE":
            box.contexts.discard(rest[1])
            return 200, _success({"id": rest[1]})
        return _error(404, "NotFound", f"no such path {'/'.join(rest)}")

    def _create(self, body: dict[str, Any]) -> tuple[int, Any]:
        template = body.get("templateName")
        if template not in self.templates:
            return _error(404, "TemplateNotFound", f"template {template} does not exist")
        sandbox_id = str(body.get("sandboxId") or f"sb-{secrets.token_hex(8)}")
        with self.lock:
            if sandbox_id in self.sandboxes:
                return _error(409, "SandboxAlreadyExists", f"sandbox {sandbox_id} already exists")
            box = StandinSandbox(
                sandbox_id,
                str(template),
                body.get("sandboxIdleTimeoutSeconds"),
                datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            )
            self.sandboxes[sandbox_id] = box
        return 200, _success(box.as_api())

    def _delete(self, box: StandinSandbox) -> dict[str, Any]:
        with self.lock:
            self.sandboxes.pop(box.sandbox_id, None)
            self.deleted.append(box.sandbox_id)
            box.status = "TERMINATED"
            if box.process is not None:
                box.process.kill()
        return box.as_api()

    def _new_context(self, box: StandinSandbox, body: dict[str, Any]) -> tuple[int, Any]:
        language = body.get("language", "python")
        if language not in ("python", "javascript"):
            return _error(400, "InvalidParameter", f"unsupported language {language}")
        context_id = f"ctx-{secrets.token_hex(6)}"
        box.contexts.add(context_id)
        return 200, {"id": context_id, "cwd": body.get("cwd", "/home/user"), "language": language}

    def _execute(self, box: StandinSandbox, body: dict[str, Any]) -> tuple[int, Any]:
        context_id = body.get("contextId")
        if context_id is not None and context_id not in box.contexts:
            return _error(404, "ContextNotFound", f"context {context_id} does not exist")
        timeout = min(float(body.get("timeout") or HARD_TIMEOUT_S), HARD_TIMEOUT_S)
        with tempfile.TemporaryDirectory(prefix="agentrun-standin-") as cwd:
            process = subprocess.Popen(
                [sys.executable, "-c", str(body.get("code", ""))],
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={"PATH": os.environ.get("PATH", ""), "HOME": cwd},
            )
            with self.lock:
                box.process = process
                box.executions += 1
            try:
                stdout, stderr = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                return _error(
                    500, "ExecutionTimeout", f"code execution timeout after {timeout:g} seconds"
                )
            finally:
                box.process = None
        if box.status == "TERMINATED":
            return _error(500, "InternalError", "the sandbox was deleted during execution")
        results = [{"type": "stdout", "text": stdout}] if stdout else []
        results += [{"type": "stderr", "text": stderr}] if stderr else []
        status = "ok" if process.returncode == 0 else "error"
        results.append({"type": "endOfExecution", "status": status})
        return 200, {"contextId": context_id, "results": results}


def _success(data: Any) -> dict[str, Any]:
    return {"code": "SUCCESS", "requestId": _request_id(), "data": data}


def _error(status: int, code: str, message: str) -> tuple[int, Any]:
    return status, {"code": code, "message": message, "requestId": _request_id()}


def _request_id() -> str:
    return secrets.token_hex(8).upper()


def _handler_for(standin: AgentRunStandin) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return  # quiet: tests read standin.requests

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            path = urlsplit(self.path).path
            with standin.lock:
                standin.requests.append(RecordedRequest(self.command, path, body))
            delay = standin.take_delay(path)
            if delay:
                time.sleep(delay)
            url = f"http://{self.headers.get('Host')}{self.path}"
            refused = standin.check_signature(self.command, url, self.headers)
            fault = standin.take_fault(self.command, path)
            if refused is not None:
                status, answer = _error(*refused)
            elif fault is not None:
                status, answer = _error(fault.status, fault.code, fault.message)
            else:
                status, answer = standin.route(self.command, path, body)
            self._answer(status, answer)

        def _answer(self, status: int, answer: Any) -> None:
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("x-acs-request-id", str(answer.get("requestId", "")))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _serve  # noqa: N815

    return Handler
