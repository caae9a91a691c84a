"""A small Python client for corral's interactive sessions (docs/sessions.md).

The same shape as NeMo Gym's sandbox facade: ``create``, ``exec``, ``upload_file``,
``download_file``, ``close``, a context manager, and an async twin::

    with Session.create(api_url, token, org="acme", project="p", profile="default") as box:
        result = box.exec(["echo", "hello"])
        box.upload_file(b"data", "in/data.txt")
        assert box.download_file("in/data.txt") == b"data"

    async with await AsyncSession.create(api_url, token, org=..., ...) as box:
        result = await box.exec("echo $HOME")  # a string runs through /bin/sh -c

Each call is written once, as a generator of HTTP requests (and of pauses while it waits for
the session to be ready); :class:`Session` sends them with ``httpx.Client``,
:class:`AsyncSession` with ``httpx.AsyncClient`` (:mod:`corral.client.steps`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx

from corral.client.errors import ClientError
from corral.client.steps import Steps, run, run_async


class SessionError(ClientError):
    """The api refused a session call; ``status`` is its HTTP status."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


class SessionEndedError(SessionError):
    """The session ended (closed, idle, expired, or its sandbox failed)."""


@dataclass(frozen=True)
class ExecResult:
    """What a command did. A non-zero exit is a result, not an error."""

    stdout: str
    stderr: str
    exit_code: int
    duration_s: float = 0.0
    timed_out: bool = False  # killed at its timeout (exit code 124)
    truncated: bool = False  # stdout or stderr was cut at the api's output limit

    @property
    def return_code(self) -> int:
        """The reference facade's name for :attr:`exit_code`."""
        return self.exit_code


def _answer(response: httpx.Response | None, *expected: int) -> httpx.Response:
    assert response is not None
    if response.status_code not in expected:
        try:
            detail: Any = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise SessionError(response.status_code, str(detail))
    return response


@dataclass(frozen=True)
class _Calls:
    """The requests of each call, and how their answers read; no transport of its own."""

    api_url: str
    token: str = field(repr=False)  # an org key or the admin token: never in a repr

    def request(
        self, method: str, path: str, *, headers: Mapping[str, str] | None = None, **kwargs: Any
    ) -> httpx.Request:
        sent = {"Authorization": f"Bearer {self.token}", **(headers or {})}
        return httpx.Request(method, f"{self.api_url.rstrip('/')}{path}", headers=sent, **kwargs)

    def create(self, body: Mapping[str, Any], ready_timeout_s: float, poll_s: float) -> Steps[str]:
        created = _answer((yield self.request("POST", "/v1/sessions", json=dict(body))), 201)
        session = created.json()
        deadline = time.monotonic() + ready_timeout_s
        while session["state"] != "ready":
            if session["state"] == "ended":
                why = session.get("error") or session.get("end_reason")
                raise SessionEndedError(409, f"session {session['id']} ended: {why}")
            if time.monotonic() > deadline:
                yield from self.close(session["id"])
                raise TimeoutError(
                    f"session {session['id']} was not ready within {ready_timeout_s:g} s (closed)"
                )
            yield poll_s
            read = _answer((yield self.request("GET", f"/v1/sessions/{session['id']}")), 200)
            session = read.json()
        return str(session["id"])

    def exec(
        self,
        session_id: str,
        command: str | Sequence[str],
        env: Mapping[str, str] | None,
        cwd: str | None,
        timeout: float | None,
    ) -> Steps[ExecResult]:
        shell = isinstance(command, str)
        body: dict[str, Any] = {"command": command if shell else list(command), "shell": shell}
        if env:
            body["env"] = dict(env)
        if cwd is not None:
            body["cwd"] = cwd
        if timeout is not None:
            body["timeout_s"] = timeout
        path = f"/v1/sessions/{session_id}/exec"
        # The api may hold the call for the whole timeout: wait a little longer than that.
        wait = httpx.Timeout(30.0, read=(timeout or 600.0) + 30.0)
        request = self.request("POST", path, json=body, extensions={"timeout": wait.as_dict()})
        answer = _answer((yield request), 200)
        return ExecResult(**answer.json())

    def upload(
        self, session_id: str, source: str | os.PathLike[str] | bytes, remote: str
    ) -> Steps[None]:
        content = source if isinstance(source, bytes) else Path(source).read_bytes()
        path = f"/v1/sessions/{session_id}/files/{quote(remote, safe='/')}"
        headers = {"Content-Type": "application/octet-stream"}
        _answer((yield self.request("PUT", path, content=content, headers=headers)), 200)
        return None

    def download(self, session_id: str, remote: str) -> Steps[bytes]:
        path = f"/v1/sessions/{session_id}/files/{quote(remote, safe='/')}"
        return _answer((yield self.request("GET", path)), 200).content

    def status(self, session_id: str) -> Steps[dict[str, Any]]:
        answer = _answer((yield self.request("GET", f"/v1/sessions/{session_id}")), 200)
        result: dict[str, Any] = answer.json()
        return result

    def close(self, session_id: str) -> Steps[None]:
        _answer((yield self.request("DELETE", f"/v1/sessions/{session_id}")), 200, 404)
        return None


def _create_body(org: str, project: str, profile: str, **fields: Any) -> dict[str, Any]:
    body = {"org": org, "project": project, "profile": profile}
    body.update({name: value for name, value in fields.items() if value is not None})
    return body


class Session:
    """A live sandbox: create it, run commands, move files, close it (or use ``with``)."""

    def __init__(self, calls: _Calls, client: httpx.Client, session_id: str) -> None:
        self._calls = calls
        self._client = client
        self.id = session_id

    @classmethod
    def create(
        cls,
        api_url: str,
        token: str,
        *,
        org: str,
        project: str,
        profile: str,
        ready_timeout_s: float = 300.0,
        poll_interval_s: float = 0.5,
        transport: httpx.BaseTransport | None = None,
        **fields: Any,
    ) -> Session:
        """Create a session and wait until it is ready. ``fields`` are the rest of
        ``POST /v1/sessions``: provider, agent_card, resources, env, egress, image, region,
        arch, toolchain, idle_ttl_s, ttl_s.

        Raises:
            SessionError: the api refused it (409: no pool can hold it).
            SessionEndedError: it ended before it was ready.
            TimeoutError: not ready within ``ready_timeout_s`` (it is closed).
        """
        calls = _Calls(api_url, token)
        client = httpx.Client(transport=transport, timeout=30.0)
        try:
            body = _create_body(org, project, profile, **fields)
            session_id = run(client, calls.create(body, ready_timeout_s, poll_interval_s))
        except BaseException:
            client.close()
            raise
        return cls(calls, client, session_id)

    def exec(
        self,
        command: str | Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        """Run ``command`` (an argv list; a string runs through ``/bin/sh -c``)."""
        return run(self._client, self._calls.exec(self.id, command, env, cwd, timeout))

    def upload_file(self, source: str | os.PathLike[str] | bytes, remote_path: str) -> None:
        """Put a local file (or bytes) at ``remote_path``, relative to the work directory."""
        run(self._client, self._calls.upload(self.id, source, remote_path))

    def download_file(self, remote_path: str) -> bytes:
        """The bytes of the file at ``remote_path``."""
        return run(self._client, self._calls.download(self.id, remote_path))

    def status(self) -> dict[str, Any]:
        """The session as the api shows it (state, TTLs, how it ended)."""
        return run(self._client, self._calls.status(self.id))

    def close(self) -> None:
        """End the session (its sandbox is ended and billed); safe to call twice."""
        if self._client.is_closed:
            return
        try:
            run(self._client, self._calls.close(self.id))
        finally:
            self._client.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class AsyncSession:
    """:class:`Session` for asyncio: the same calls, awaited."""

    def __init__(self, calls: _Calls, client: httpx.AsyncClient, session_id: str) -> None:
        self._calls = calls
        self._client = client
        self.id = session_id

    @classmethod
    async def create(
        cls,
        api_url: str,
        token: str,
        *,
        org: str,
        project: str,
        profile: str,
        ready_timeout_s: float = 300.0,
        poll_interval_s: float = 0.5,
        transport: httpx.AsyncBaseTransport | None = None,
        **fields: Any,
    ) -> AsyncSession:
        """As :meth:`Session.create`."""
        calls = _Calls(api_url, token)
        client = httpx.AsyncClient(transport=transport, timeout=30.0)
        try:
            body = _create_body(org, project, profile, **fields)
            steps = calls.create(body, ready_timeout_s, poll_interval_s)
            session_id = await run_async(client, steps)
        except BaseException:
            await client.aclose()
            raise
        return cls(calls, client, session_id)

    async def exec(
        self,
        command: str | Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        return await run_async(self._client, self._calls.exec(self.id, command, env, cwd, timeout))

    async def upload_file(self, source: str | os.PathLike[str] | bytes, remote_path: str) -> None:
        await run_async(self._client, self._calls.upload(self.id, source, remote_path))

    async def download_file(self, remote_path: str) -> bytes:
        return await run_async(self._client, self._calls.download(self.id, remote_path))

    async def status(self) -> dict[str, Any]:
        return await run_async(self._client, self._calls.status(self.id))

    async def close(self) -> None:
        if self._client.is_closed:
            return
        try:
            await run_async(self._client, self._calls.close(self.id))
        finally:
            await self._client.aclose()

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()
