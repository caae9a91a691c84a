"""The api as a real process (``python -m corral api``) on PostgreSQL, attacked over TCP: huge
bodies cost it a few MB at most, and a runner session flooding it with logs is throttled and
kept within its item's log budget."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import httpx
import pytest
from sqlalchemy import func
from sqlalchemy import select as sql_select

from corral.shared.store.db import Database
from corral.shared.store.models import WorkItem, WorkItemLog
from tests.acceptance.stack import free_port
from tests.bundle_archives import (
    Member,
    archive,
    file_entry,
    gzip_stream,
    header,
    manifest,
    manifest_blocks,
)
from tests.integration.test_api import ADMIN, awaiting_item

REPO = Path(__file__).resolve().parents[2]
MB = 1_000_000
GIB = 1 << 30
BUDGET_LINES = 500
BUDGET_BYTES = 20_000
GZIP = "application/gzip"


@dataclass
class ApiProcess:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def peak_rss_kib(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise AssertionError("no VmHWM")

    def reset_peak_rss(self) -> None:
        """Start VmHWM again from the process's present RSS (Linux 4.0 and later)."""
        Path(f"/proc/{self.process.pid}/clear_refs").write_text("5")

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)

    def register(self, token: str) -> str:
        connection = self.connection()
        try:
            body = json.dumps({"token": token})
            connection.request(
                "POST", "/v1/runner/register", body, {"Content-Type": "application/json"}
            )
            answer = connection.getresponse()
            assert answer.status == 200, answer.read()
            session: str = json.loads(answer.read())["session_token"]
        finally:
            connection.close()
        return session


@pytest.fixture(scope="module")
def api(
    postgres_database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ApiProcess]:
    state = tmp_path_factory.mktemp("api")
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "CORRAL_STATE_DIR": str(state),
        "CORRAL_DATABASE_URL": postgres_database_url,
        "CORRAL_BROKER_URL": "memory://",
        "CORRAL_API_PORT": str(port),
        "CORRAL_ADMIN_TOKEN": ADMIN,
        "CORRAL_LOG_BUDGET_LINES": str(BUDGET_LINES),
        "CORRAL_LOG_BUDGET_BYTES": str(BUDGET_BYTES),
    }
    log = state / "api.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "corral", "api", "--no-unix"],
            env=env,
            cwd=state,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    api = ApiProcess(process, port, log)
    try:
        _wait_until_healthy(api)
        yield api
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _wait_until_healthy(api: ApiProcess, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert api.process.poll() is None, api.log.read_text()
        connection = api.connection()
        try:
            connection.request("GET", "/healthz")
            with connection.getresponse() as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
        finally:
            connection.close()
    raise TimeoutError(api.log.read_text())


def _head(api: ApiProcess, session: str, framing: str) -> bytes:
    return (
        f"POST /v1/runner/complete HTTP/1.1\r\nHost: 127.0.0.1:{api.port}\r\n"
        f"Authorization: Bearer {session}\r\nContent-Type: application/json\r\n"
        f"{framing}\r\n\r\n"
    ).encode()


def _read_status(sock: socket.socket, timeout_s: float) -> int | None:
    """The status code of the answer waiting on ``sock``; None if the connection was reset
    (a server that closes with a body left unread sends RST, which may eat its answer)."""
    sock.settimeout(timeout_s)
    try:
        head = sock.recv(65536)
    except (ConnectionResetError, TimeoutError):
        return None
    return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else None


def stream_chunked(api: ApiProcess, session: str, total: int = 100 * MB) -> tuple[int, int | None]:
    """Send a ``total``-byte chunked body until the server answers or drops the connection;
    the bytes sent and the answer's status."""
    chunk = b"x" * 65536
    framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    sent = 0
    with socket.create_connection(("127.0.0.1", api.port), timeout=30) as sock:
        opening = b'{"exit_code": 0, "result": "'
        head = _head(api, session, "Transfer-Encoding: chunked")
        sock.sendall(head + f"{len(opening):x}\r\n".encode() + opening + b"\r\n")
        try:
            while sent < total:
                if select.select([sock], [], [], 0)[0]:
                    break  # the server answered: stop sending
                sock.sendall(framed)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            return sent, None
        return sent, _read_status(sock, 10)


def test_a_100_mb_complete_is_refused_without_the_api_growing(
    api: ApiProcess, pg_db: Database
) -> None:
    _, token = awaiting_item(pg_db, f"org-{uuid.uuid4().hex[:8]}")
    session = api.register(token)

    # Declared: refused from the headers alone, before a byte of the body is sent.
    with socket.create_connection(("127.0.0.1", api.port), timeout=30) as sock:
        sock.sendall(_head(api, session, f"Content-Length: {100 * MB}"))
        assert _read_status(sock, 10) == 413

    stream_chunked(api, session)  # warm-up: whatever the first one allocates for good
    before = api.rss_kib()
    results: list[tuple[int, int | None]] = []
    streams = [
        threading.Thread(target=lambda: results.append(stream_chunked(api, session)))
        for _ in range(3)
    ]
    for thread in streams:
        thread.start()
    for thread in streams:
        thread.join(timeout=120)
    after = api.rss_kib()

    assert len(results) == 3
    for sent, status in results:
        assert sent < 40 * MB  # the api stopped reading near its 2 MiB limit
        assert status in (413, None)  # None: the answer was lost to the connection's reset
    # KiB. Each refused body was read up to the 2 MiB limit (and joined once): three at
    # once may leave the allocator a few MB larger, never the hundreds a body used to cost.
    assert after - before < 16 * 1024, (before, after)
    with pg_db.session() as session_:
        running = session_.scalar(
            sql_select(func.count())
            .select_from(WorkItem)
            .where(WorkItem.state == "running", WorkItem.result.is_not(None))
        )
    assert running == 0  # nothing was completed


def _read_answer(stream: BinaryIO) -> tuple[int, dict[str, str], bytes]:
    status = int(stream.readline().split(b" ", 2)[1])
    headers = {}
    while (line := stream.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, stream.read(int(headers["content-length"]))


def flood(api: ApiProcess, session: str, body: bytes, calls: int) -> list[tuple[int, int]]:
    """``calls`` logs posts over one connection, pipelined 100 at a time (so that a loaded
    machine's scheduling does not pace them): (status, lines dropped) of each."""
    request = (
        f"POST /v1/runner/logs HTTP/1.1\r\nHost: 127.0.0.1:{api.port}\r\n"
        f"Authorization: Bearer {session}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    results = []
    # The stream is closed with the socket: a reader left to the garbage collector keeps the
    # socket open and warns in whichever later test collects it.
    with (
        socket.create_connection(("127.0.0.1", api.port), timeout=60) as sock,
        sock.makefile("rb") as stream,
    ):
        while len(results) < calls:
            window = min(100, calls - len(results))
            sock.sendall(request * window)
            for _ in range(window):
                status, headers, data = _read_answer(stream)
                if status == 429:
                    assert headers["retry-after"] == "1"
                dropped = json.loads(data)["dropped"] if status == 200 else 0
                results.append((status, dropped))
    return results


def test_a_log_flood_from_one_session_is_throttled_and_kept_within_the_budget(
    api: ApiProcess, pg_db: Database
) -> None:
    item_id, token = awaiting_item(pg_db, f"org-{uuid.uuid4().hex[:8]}")
    session = api.register(token)
    lines = [{"line": f"{n:04d} " + "y" * 95} for n in range(10)]
    batch = json.dumps({"lines": lines}).encode()
    # 10,000 calls from 4 connections at once: far faster than one session's 20 calls/s
    # (burst 100, the defaults).
    with ThreadPoolExecutor(max_workers=4) as pool:
        batches = list(pool.map(lambda _: flood(api, session, batch, 2500), range(4)))
    results = [result for batch_results in batches for result in batch_results]
    statuses = Counter(status for status, _ in results)
    dropped = sum(lines for _, lines in results)

    assert len(results) == 10_000
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[429] > 5_000, statuses
    assert statuses[200] >= 100, statuses  # the burst, at least
    with pg_db.session() as db_session:
        stored_lines, stored = db_session.execute(
            sql_select(
                func.count(), func.coalesce(func.sum(func.length(WorkItemLog.line)), 0)
            ).where(WorkItemLog.work_item_id == item_id)
        ).one()
        item = db_session.get(WorkItem, item_id)
        assert item is not None
        assert (item.log_lines, item.log_dropped_lines) == (stored_lines, dropped)
    # Lines of 100 bytes: the byte budget is reached first, at 200 lines.
    assert stored_lines == BUDGET_BYTES // 100 <= BUDGET_LINES
    assert stored <= BUDGET_BYTES
    assert dropped == 10 * statuses[200] - stored_lines


def _call(
    api: ApiProcess,
    method: str,
    path: str,
    session: str,
    body: bytes | BinaryIO = b"",
    **headers: str,
) -> tuple[int, bytes]:
    connection = api.connection()
    try:
        connection.request(method, path, body, {"Authorization": f"Bearer {session}", **headers})
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


def test_a_90_mb_bundle_is_kept_and_streamed_back_without_the_api_growing(
    api: ApiProcess, pg_db: Database, tmp_path: Path
) -> None:
    item_id, token = awaiting_item(pg_db, f"org-{uuid.uuid4().hex[:8]}", bundle=True)
    session = api.register(token)
    claim_headers = {"Content-Type": "application/json"}
    status, claim = _call(api, "POST", "/v1/runner/claim", session, b"{}", **claim_headers)
    assert status == 200 and json.loads(claim)["bundle"]["max_bytes"] == 100 * MB
    data = os.urandom(90 * MB)  # incompressible: the archive is as large as its content
    archive = tmp_path / "bundle.tar.gz"
    with archive.open("wb") as out:
        out.write(_archive_of({"big.bin": data}))
    del data
    before = api.rss_kib()
    with archive.open("rb") as body:
        status, answer = _call(
            api,
            "PUT",
            "/v1/runner/bundle",
            session,
            body,
            **{"Content-Type": "application/gzip", "Content-Length": str(archive.stat().st_size)},
        )
    assert status == 200, answer
    during = api.rss_kib()
    digest = hashlib.sha256()
    connection = api.connection()
    try:
        connection.request(
            "GET", f"/v1/work-items/{item_id}/bundle", headers={"Authorization": f"Bearer {ADMIN}"}
        )
        got = connection.getresponse()
        assert got.status == 200
        while chunk := got.read(1 << 20):
            digest.update(chunk)
    finally:
        connection.close()
    after = api.rss_kib()
    assert digest.hexdigest() == hashlib.sha256(archive.read_bytes()).hexdigest()
    # KiB: the body went to a file and back out in chunks, never whole into memory.
    assert max(during, after) - before < 24 * 1024, (before, during, after)


def test_a_bundle_declaring_a_gibibyte_pax_header_is_refused_without_the_api_growing(
    api: ApiProcess, pg_db: Database
) -> None:
    """Before, tarfile read a pax header's declared size into memory before any of the
    bundle's checks: this upload of about 1 MB took the api's peak RSS up by over 2 GB."""
    body = gzip_stream(manifest_blocks() + header("././@PaxHeader", GIB, typeflag=b"x"), zeros=GIB)
    assert len(body) < 2 * MB

    def upload() -> tuple[int, bytes]:
        _, token = awaiting_item(pg_db, f"org-{uuid.uuid4().hex[:8]}", bundle=True)
        session = api.register(token)
        json_body = {"Content-Type": "application/json"}
        assert _call(api, "POST", "/v1/runner/claim", session, b"{}", **json_body)[0] == 200
        return _call(api, "PUT", "/v1/runner/bundle", session, body, **{"Content-Type": GZIP})

    upload()  # the route's code paths warmed up, so the second measures the upload alone
    api.reset_peak_rss()
    before = api.peak_rss_kib()
    status, answer = upload()
    growth = api.peak_rss_kib() - before
    assert growth < 10 * 1024, (before, growth)  # KiB
    assert status == 422, answer
    refusal = json.loads(answer)
    assert refusal["error"] == "bundle_invalid"
    assert refusal["detail"][0]["message"].startswith(
        "member 2 is not a regular file but a pax extended header"
    )


def _archive_of(files: dict[str, bytes]) -> bytes:
    entries = [file_entry(path, data) for path, data in files.items()]
    members: list[Member] = [manifest(*entries)]
    members += [(f"files/{path}", data) for path, data in files.items()]
    return archive(members).getvalue()


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_client_just_over_the_limit_always_reads_its_413(api: ApiProcess, framing: str) -> None:
    """A body a little over its route's limit is read and dropped before the 413 is sent, so
    the connection ends with the answer and a clean close: answered with the body still
    unread, the close is a reset, which reached the client before the answer now and then."""
    body = b"x" * (64 * 1024 + 1)  # the default route limit, plus one byte
    # Chunked, the limit is passed mid-stream: the rest still comes after it.
    chunks = b"x" * (64 * 1024 + 200_000)
    headers = {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}
    outcomes: Counter[str] = Counter()
    with httpx.Client(base_url=f"http://127.0.0.1:{api.port}", headers=headers) as client:
        for _ in range(200):
            # On a kept-alive connection, as a client library sends it after other calls.
            assert client.get("/healthz").status_code == 200
            content = (
                body
                if framing == "length"
                else iter([chunks[n : n + 8192] for n in range(0, len(chunks), 8192)])
            )
            try:
                outcomes[str(client.post("/v1/admin/pools", content=content).status_code)] += 1
            except httpx.TransportError as exc:
                outcomes[type(exc).__name__] += 1
    assert outcomes == {"413": 200}
