"""The in-sandbox runner, run for real (``python -m runner``) against a fake control plane.

The fake is a threaded stdlib HTTP server, on TCP or on a Unix socket, that records every
request and answers as the runner protocol says.
"""

from __future__ import annotations

import http.server
import json
import os
import shlex
import shutil
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from corral.runner.logs import MAX_LINE_BYTES, LogShipper, truncate

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKEN = "crt_registration-secret-0123456789"
SESSION = "crs_session-secret-9876543210"
ENROLMENT = "cre_enrolment-secret-0123456789"  # a warm runner's
CHANNEL = "crw_channel-secret-9876543210"


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class FakeControlPlane:
    """Answers the runner API for one work item and records what the runner sent."""

    claim: dict[str, Any]
    heartbeat_interval_s: float = 0.2
    register_failures: list[int] = field(default_factory=list)  # statuses before a 200
    claim_status: int = 200
    heartbeat_status: int = 200
    cancel_on_line: str | None = None  # heartbeats answer cancel once this line was logged
    throttled: dict[str, int] = field(default_factory=dict)  # 429s left, by path
    retry_after: str = "0.1"
    logs_answer: dict[str, Any] = field(default_factory=dict)
    empty_waits: int = 2  # a warm runner's waits answered "nothing yet" before the token
    channel_closed: bool = False  # warm waits answer 401
    claim_with_registration: bool = False  # a registration asking to claim carries the claim
    url: str = ""
    requests: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(self, path: str, headers: dict[str, str], body: Any) -> tuple[Any, ...]:
        with self.lock:
            self.requests.append(Request(path, headers, body))
            throttle = self.throttled.get(path, 0) > 0
            if throttle:
                self.throttled[path] -= 1
        if throttle:
            return 429, {"error": "rate_limited"}, {"Retry-After": self.retry_after}
        return self.answer(path, headers, body)

    def answer(self, path: str, headers: dict[str, str], body: Any) -> tuple[int, Any]:
        if path in ("/v1/runner/register", "/v1/runner/enrol", "/v1/runner/warm/wait"):
            return self.unregistered(path, headers, body)
        if headers.get("Authorization") != f"Bearer {SESSION}":
            return 401, {"detail": "unauthorized"}
        if path == "/v1/runner/claim":
            return self.claim_status, self.claim
        if path == "/v1/runner/heartbeat":
            return self.heartbeat()
        if path in ("/v1/runner/logs", "/v1/runner/complete"):
            return 200, self.logs_answer if path.endswith("logs") else {}
        return 404, {"detail": "not found"}

    def register(self, body: Any) -> tuple[int, Any]:
        if self.register_failures:
            return self.register_failures.pop(0), {"detail": "unavailable"}
        if body.get("token") != TOKEN:
            return 401, {"detail": "unauthorized"}
        carried = self.claim_with_registration and body.get("claim") is True
        return 200, {
            "session_token": SESSION,
            "sandbox_id": "sb-test",
            "work_item_id": "wi-test",
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "claim": self.claim if carried else None,
        }

    def unregistered(self, path: str, headers: dict[str, str], body: Any) -> tuple[int, Any]:
        """Register; or a warm runner's calls: enrol with ENROLMENT, then waits on CHANNEL
        that answer the registration token after ``empty_waits`` empty ones."""
        if path == "/v1/runner/register":
            return self.register(body)
        if path == "/v1/runner/enrol":
            if body.get("token") != ENROLMENT:
                return 401, {"detail": "unauthorized"}
            return 200, {"channel_token": CHANNEL, "sandbox_id": "wm-test", "wait_s": 0.1}
        if headers.get("Authorization") != f"Bearer {CHANNEL}" or self.channel_closed:
            return 401, {"detail": "unauthorized"}
        with self.lock:
            self.empty_waits -= 1
            empty = self.empty_waits >= 0
        return 200, {"registration_token": None if empty else TOKEN}

    def heartbeat(self) -> tuple[int, Any]:
        if self.heartbeat_status != 200:
            return self.heartbeat_status, {"detail": "refused"}
        return 200, {
            "cancel": self.cancel_on_line is not None and self.cancel_on_line in self.lines()
        }

    def paths(self) -> list[str]:
        with self.lock:
            return [request.path for request in self.requests]

    def log_entries(self) -> list[dict[str, Any]]:
        with self.lock:
            # The last lines come with the completion report (runner/logs.py take_final).
            batches = [
                r.body.get("lines", [])
                for r in self.requests
                if r.path in ("/v1/runner/logs", "/v1/runner/complete")
            ]
        return [entry for batch in batches for entry in batch]

    def lines(self, stream: str | None = None) -> list[str]:
        return [
            entry["line"]
            for entry in self.log_entries()
            if stream is None or entry["stream"] == stream
        ]

    def completion(self) -> dict[str, Any]:
        completions = [r.body for r in self.requests if r.path == "/v1/runner/complete"]
        assert len(completions) == 1, self.paths()
        body: dict[str, Any] = completions[0]
        return body


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"null")
        plane: FakeControlPlane = self.server.plane  # type: ignore[attr-defined]
        status, answer, *extra = plane.handle(self.path, dict(self.headers), body)
        data = json.dumps(answer).encode()
        self.send_response(status)
        for name, value in (extra[0] if extra else {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean


class _TCPServer(http.server.ThreadingHTTPServer):
    plane: FakeControlPlane


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    plane: FakeControlPlane


PlaneFactory = Callable[..., FakeControlPlane]


@pytest.fixture
def control_plane() -> Iterator[PlaneFactory]:
    """Start fake control planes (``unix=True`` for a Unix socket); stopped after the test."""
    started: list[tuple[socketserver.BaseServer, threading.Thread, str | None]] = []

    def start(claim: dict[str, Any], *, unix: bool = False, **options: Any) -> FakeControlPlane:
        plane = FakeControlPlane(claim=claim, **options)
        server: _TCPServer | _UnixHTTPServer
        socket_dir = None
        if unix:
            # Short: a Unix socket path is limited to about 100 bytes.
            socket_dir = tempfile.mkdtemp(prefix="crl-", dir="/tmp")
            server = _UnixHTTPServer(os.path.join(socket_dir, "api.sock"), _Handler)
            plane.url = f"unix://{socket_dir}/api.sock"
        else:
            server = _TCPServer(("127.0.0.1", 0), _Handler)
            plane.url = f"http://127.0.0.1:{server.server_address[1]}"
        server.plane = plane
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
        thread.start()
        started.append((server, thread, socket_dir))
        return plane

    yield start
    for server, thread, socket_dir in started:
        server.shutdown()
        server.server_close()
        thread.join()
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)


def run_runner(
    plane: FakeControlPlane | None,
    workdir: Path,
    *,
    env: dict[str, str] | None = None,
    user: int | None = None,
    python: str = sys.executable,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m runner`` in ``workdir`` the way a provider starts it (as ``user``,
    with the same group, when given)."""
    full_env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(REPO_ROOT),
        "CORRAL_REGISTRATION_TOKEN": TOKEN,
        "CORRAL_SANDBOX_ID": "sb-test",
    }
    if plane is not None:
        full_env["CORRAL_CONTROL_URL"] = plane.url
    full_env.update(env or {})
    return subprocess.run(
        [python, "-m", "runner"],
        cwd=workdir,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        user=user,
        group=user,
        extra_groups=None if user is None else [],
    )


def shell(command: str, **claim: Any) -> dict[str, Any]:
    return {"work_item_id": "wi-test", "work": {"kind": "shell", "command": command}, **claim}


def code(source: str, arguments: dict[str, Any] | None = None, **claim: Any) -> dict[str, Any]:
    work = {"kind": "code", "language": "python", "code": source, "arguments": arguments or {}}
    return {"work_item_id": "wi-test", "work": work, **claim}


def test_shell_work_succeeds_and_streams_its_output(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    plane = control_plane(shell("echo hello; echo oops >&2; echo bye"))

    finished = run_runner(plane, tmp_path)

    assert finished.returncode == 0, finished.stderr
    completion = plane.completion()
    assert completion["exit_code"] == 0
    assert completion["phase"] == "work"
    assert completion["error"] is None
    assert completion["cancelled"] is False
    assert completion["result"] is None
    assert completion["duration_s"] >= 0
    assert plane.lines("stdout") == ["hello", "bye"]
    assert plane.lines("stderr") == ["oops"]
    paths = plane.paths()
    assert paths[:2] == ["/v1/runner/register", "/v1/runner/claim"]
    # The work's last lines and the runner's summary come with the report: no call of their
    # own before it.
    assert "/v1/runner/logs" not in paths[: paths.index("/v1/runner/complete")]
    assert completion["lines"][-1]["stream"] == "system"
    register = plane.requests[0].body
    assert register["token"] == TOKEN
    assert register["runner_version"]
    assert all(r.headers.get("Authorization") == f"Bearer {SESSION}" for r in plane.requests[1:])


def test_a_claim_carried_by_the_registration_runs_with_no_claim_call(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    plane = control_plane(shell("echo carried"), claim_with_registration=True)

    finished = run_runner(plane, tmp_path)

    assert finished.returncode == 0, finished.stderr
    assert plane.requests[0].body["claim"] is True
    assert "/v1/runner/claim" not in plane.paths()
    assert plane.lines("stdout") == ["carried"]


def test_a_malformed_claim_carried_by_the_registration_is_reported_as_one(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    plane = control_plane({"work": {"kind": "teleport"}}, claim_with_registration=True)

    run_runner(plane, tmp_path)

    completion = plane.completion()
    assert completion["exit_code"] == 2
    assert completion["error"].startswith("malformed claim: ")
    assert "/v1/runner/claim" not in plane.paths()


def test_code_work_returns_mains_json_result(control_plane: PlaneFactory, tmp_path: Path) -> None:
    source = (
        "def main(x, y):\n"
        "    print('adding', x, 'and', y)\n"
        "    return {'sum': x + y, 'inputs': [x, y], 'nested': {'ok': True}}\n"
    )
    plane = control_plane(code(source, {"x": 1, "y": 2}))

    finished = run_runner(plane, tmp_path)

    assert finished.returncode == 0, finished.stderr
    completion = plane.completion()
    assert completion["exit_code"] == 0
    assert completion["error"] is None
    assert completion["result"] == {"sum": 3, "inputs": [1, 2], "nested": {"ok": True}}
    assert "adding 1 and 2" in plane.lines("stdout")


def test_failing_install_step_aborts_before_the_work(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    plane = control_plane(
        shell(
            "touch work_ran",
            install_commands=["true", "echo installing; exit 3"],
            post_acquire=["touch post_acquire_ran"],
        )
    )

    finished = run_runner(plane, tmp_path)

    assert finished.returncode == 1
    completion = plane.completion()
    assert completion["phase"] == "install"
    assert completion["exit_code"] == 3
    assert completion["error"] == "install step 2 failed with exit code 3: echo installing; exit 3"
    assert not (tmp_path / "work_ran").exists()
    assert not (tmp_path / "post_acquire_ran").exists()
    assert "installing" in plane.lines("stdout")


def test_post_acquire_runs_after_install_and_before_the_work(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    plane = control_plane(
        shell(
            "echo work-ran",
            install_commands=["echo install-1", "echo install-2"],
            post_acquire=["echo post-acquire"],
            env={"GREETING": "from-claim"},
        )
    )

    finished = run_runner(plane, tmp_path)

    assert finished.returncode == 0, finished.stderr
    assert plane.lines("stdout") == ["install-1", "install-2", "post-acquire", "work-ran"]


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("def main():\n    raise ValueError('boom')\n", "main() raised ValueError: boom"),
        ("def helper():\n    return 1\n", "the code defines no main() function"),
        ("import nowhere_to_be_found\n", "loading the code raised ModuleNotFoundError"),
    ],
)
def test_failing_code_reports_why(
    control_plane: PlaneFactory, tmp_path: Path, source: str, error: str
) -> None:
    plane = control_plane(code(source))

    finished = run_runner(plane, tmp_path)

    assert finished.returncode == 1
    completion = plane.completion()
    assert completion["exit_code"] == 1
    assert completion["error"].startswith(error)
    assert completion["result"] is None


def test_main_raising_sends_its_traceback_to_the_logs(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    plane = control_plane(code("def main():\n    raise ValueError('boom')\n"))

    run_runner(plane, tmp_path)

    assert plane.completion()["error"] == "main() raised ValueError: boom"
    stderr = plane.lines("stderr")
    assert "ValueError: boom" in stderr
    assert any("Traceback" in line for line in stderr)


def test_unserialisable_result_is_an_error(control_plane: PlaneFactory, tmp_path: Path) -> None:
    plane = control_plane(code("def main():\n    return {1, 2}\n"))

    run_runner(plane, tmp_path)

    completion = plane.completion()
    assert completion["exit_code"] == 1
    assert "not JSON-serialisable" in completion["error"]


def test_unsupported_language_is_refused(control_plane: PlaneFactory, tmp_path: Path) -> None:
    claim = code("puts 1")
    claim["work"]["language"] = "ruby"
    plane = control_plane(claim)

    run_runner(plane, tmp_path)

    completion = plane.completion()
    assert completion["exit_code"] == 2
    assert completion["error"] == "unsupported language ruby; supported: python, javascript"


def javascript(source: str, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
    claim = code(source, arguments)
    claim["work"]["language"] = "javascript"
    return claim


NODE = shutil.which("node")
needs_node = pytest.mark.skipif(
    NODE is None and not os.environ.get("CI"), reason="node is not installed"
)


@needs_node
def test_javascript_code_returns_mains_json_result(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    (tmp_path / "helper.js").write_text("module.exports = (n) => n * 10;\n")
    source = (
        "const times10 = require('./helper.js');  // resolved from the work directory\n"
        "async function main(args) {\n"
        "  console.log('adding', args.x, 'and', args.y);\n"
        "  await new Promise((resolve) => setTimeout(resolve, 10));\n"
        "  setInterval(() => {}, 1000);  // a timer left running does not hold the result\n"
        "  return {sum: args.x + args.y, scaled: times10(args.x), nested: [null, true, 'a']};\n"
        "}\n"
    )
    plane = control_plane(javascript(source, {"x": 1, "y": 2}))

    finished = run_runner(plane, tmp_path)

    assert finished.returncode == 0, finished.stderr
    completion = plane.completion()
    assert (completion["exit_code"], completion["error"]) == (0, None)
    assert completion["result"] == {"sum": 3, "scaled": 10, "nested": [None, True, "a"]}
    assert "adding 1 and 2" in plane.lines("stdout")


@needs_node
@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("function main() { throw new TypeError('boom'); }", "main() raised TypeError: boom"),
        ("async function main() { throw 'plain'; }", "main() raised a non-Error value: plain"),
        ("function helper() { return 1; }", "the code defines no main() function"),
        ("require('nowhere-to-be-found');", "loading the code raised Error: Cannot find module"),
        (
            "function main() { return {n: NaN}; }",
            "main() returned a value that is not JSON: "
            "the result.n is NaN, which JSON has no value for",
        ),
        (
            "const main = () => [1, () => 2];",
            "main() returned a value that is not JSON: the result[1] is a function",
        ),
        (
            "module.exports.main = () => new Date(0);",
            "main() returned a value that is not JSON: the result is a Date, not a plain object",
        ),
        (
            "function main() { const a = {}; a.self = a; return a; }",
            "main() returned a value that is not JSON: the result.self refers back to itself",
        ),
        (
            "function main() { return {big: 1n}; }",
            "main() returned a value that is not JSON: the result.big is a bigint",
        ),
    ],
)
def test_failing_javascript_reports_why(
    control_plane: PlaneFactory, tmp_path: Path, source: str, error: str
) -> None:
    plane = control_plane(javascript(source))

    finished = run_runner(plane, tmp_path)

    assert finished.returncode == 1
    completion = plane.completion()
    assert completion["exit_code"] == 1
    assert completion["error"].startswith(error), completion["error"]
    assert completion["result"] is None


def test_javascript_without_node_says_so(control_plane: PlaneFactory, tmp_path: Path) -> None:
    plane = control_plane(javascript("function main() { return 1; }"))
    bare = tmp_path / "bin"
    bare.mkdir()

    run_runner(plane, tmp_path, env={"PATH": str(bare)})

    error = plane.completion()["error"]
    assert "node was not found on the sandbox's PATH" in error


def test_unix_socket_control_url(control_plane: PlaneFactory, tmp_path: Path) -> None:
    plane = control_plane(
        code("def main(name):\n    return 'hi ' + name\n", {"name": "x"}), unix=True
    )
    assert plane.url.startswith("unix:///")

    finished = run_runner(plane, tmp_path)

    assert finished.returncode == 0, finished.stderr
    assert plane.completion()["result"] == "hi x"


def test_refused_registration_exits_3_without_claiming(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    plane = control_plane(shell("touch work_ran"))

    finished = run_runner(plane, tmp_path, env={"CORRAL_REGISTRATION_TOKEN": "crt_wrong"})

    assert finished.returncode == 3
    assert "registration refused: token invalid, used or expired" in finished.stderr
    assert plane.paths() == ["/v1/runner/register"]  # a 401 is not retried
    assert "crt_wrong" not in finished.stderr + finished.stdout
    assert not (tmp_path / "work_ran").exists()


def test_a_warm_runner_enrols_waits_and_registers_with_the_token_it_is_handed(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    plane = control_plane(shell("env; echo ran"))

    finished = run_runner(plane, tmp_path, env={"CORRAL_REGISTRATION_TOKEN": ENROLMENT})

    assert finished.returncode == 0, finished.stderr
    waits = ["/v1/runner/warm/wait"] * 3
    assert plane.paths()[:6] == [
        "/v1/runner/enrol",
        *waits,
        "/v1/runner/register",
        "/v1/runner/claim",
    ]
    assert "ran" in plane.lines("stdout")
    seen = finished.stdout + finished.stderr + "\n".join(plane.lines())
    for token in (ENROLMENT, CHANNEL, TOKEN, SESSION):
        assert token not in seen


def test_a_warm_runner_whose_channel_closed_exits_3_without_registering(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    plane = control_plane(shell("touch work_ran"), channel_closed=True)

    finished = run_runner(plane, tmp_path, env={"CORRAL_REGISTRATION_TOKEN": ENROLMENT})

    assert finished.returncode == 3
    assert "the warm channel was closed" in finished.stderr
    assert plane.paths() == ["/v1/runner/enrol", "/v1/runner/warm/wait"]
    assert not (tmp_path / "work_ran").exists()


def test_registration_retries_a_briefly_unavailable_control_plane(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    plane = control_plane(shell("echo ok"), register_failures=[503, 502])

    finished = run_runner(plane, tmp_path)

    assert finished.returncode == 0, finished.stderr
    assert plane.paths()[:4] == ["/v1/runner/register"] * 3 + ["/v1/runner/claim"]


def test_claim_conflict_exits_4(control_plane: PlaneFactory, tmp_path: Path) -> None:
    plane = control_plane(shell("touch work_ran"), claim_status=409)

    finished = run_runner(plane, tmp_path)

    assert finished.returncode == 4
    assert "/v1/runner/complete" not in plane.paths()
    assert not (tmp_path / "work_ran").exists()


def test_missing_configuration_exits_2(tmp_path: Path) -> None:
    finished = run_runner(None, tmp_path)

    assert finished.returncode == 2
    assert "CORRAL_CONTROL_URL" in finished.stderr
    assert TOKEN not in finished.stderr + finished.stdout


def _assert_dead(pid: int) -> None:
    # Reaped, or a zombie waiting for a reaper: either way no longer running.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return
    assert stat.rsplit(")", 1)[1].split()[0] == "Z", f"process {pid} still runs"


def test_heartbeat_cancel_kills_the_work_quickly(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    # The background sleep proves the whole process group is stopped, not only the shell.
    plane = control_plane(
        shell("sleep 30 & echo $! > sleep.pid; echo started; wait"), cancel_on_line="started"
    )

    started = time.monotonic()
    finished = run_runner(plane, tmp_path)
    elapsed = time.monotonic() - started

    assert elapsed < 10
    assert finished.returncode == 1
    completion = plane.completion()
    assert completion["cancelled"] is True
    assert completion["exit_code"] == -15
    assert completion["error"] == "cancelled by the control plane"
    _assert_dead(int((tmp_path / "sleep.pid").read_text()))


def test_refused_heartbeat_cancels_the_work(control_plane: PlaneFactory, tmp_path: Path) -> None:
    plane = control_plane(shell("sleep 30"), heartbeat_status=401)

    started = time.monotonic()
    run_runner(plane, tmp_path)

    assert time.monotonic() - started < 10
    assert plane.completion()["cancelled"] is True


def test_timeout_kills_the_work_with_exit_code_124(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    plane = control_plane(shell("echo before; sleep 30; echo after", timeout_s=1))

    started = time.monotonic()
    finished = run_runner(plane, tmp_path)

    assert time.monotonic() - started < 10
    assert finished.returncode == 1
    completion = plane.completion()
    assert completion["exit_code"] == 124
    assert completion["error"] == "timed out after 1s"
    assert completion["cancelled"] is False
    assert 1 <= completion["duration_s"] < 5
    assert plane.lines("stdout") == ["before"]


def test_tokens_stay_out_of_the_work_and_the_output(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    plane = control_plane(shell("env", env={"FROM_CLAIM": "claimed"}))

    finished = run_runner(plane, tmp_path)

    assert finished.returncode == 0, finished.stderr
    environment = plane.lines("stdout")
    assert "FROM_CLAIM=claimed" in environment  # the work's env really was logged
    assert "CORRAL_SANDBOX_ID=sb-test" in environment
    assert not any(line.startswith("CORRAL_REGISTRATION_TOKEN=") for line in environment)
    everything = json.dumps(plane.log_entries()) + finished.stdout + finished.stderr
    assert TOKEN not in everything
    assert SESSION not in everything


SCANNER = (REPO_ROOT / "tests" / "token_scan.py").read_text()


def test_the_runner_starts_the_work_with_no_token_in_its_own_environment_block(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    """Started with the token in its environment, the runner re-executes itself without it:
    /proc/<runner>/environ (the block execve was given) holds no token, yet it registered."""
    plane = control_plane(shell('tr "\\0" "\\n" < /proc/$PPID/environ'))

    finished = run_runner(plane, tmp_path)

    assert finished.returncode == 0, finished.stderr
    assert plane.requests[0].body["token"] == TOKEN  # registered with the token it was given
    block = plane.lines("stdout")
    assert "CORRAL_SANDBOX_ID=sb-test" in block  # the runner's environment really was read
    assert not any(line.startswith("CORRAL_REGISTRATION_TOKEN=") for line in block)
    # It was re-executed: the block names the pipe the token came on instead.
    assert any(line.startswith("CORRAL_REGISTRATION_TOKEN_FD=") for line in block)
    assert TOKEN not in json.dumps(plane.log_entries())


def test_a_token_on_a_pipe_registers_and_reaches_no_step(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    plane = control_plane(shell("env; ls /proc/self/fd"))
    read_end, write_end = os.pipe()
    os.write(write_end, TOKEN.encode())
    os.close(write_end)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(REPO_ROOT),
        "CORRAL_CONTROL_URL": plane.url,
        "CORRAL_REGISTRATION_TOKEN_FD": str(read_end),
    }
    try:
        finished = subprocess.run(
            [sys.executable, "-m", "runner"],
            cwd=tmp_path,
            env=env,
            pass_fds=(read_end,),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(read_end)

    assert finished.returncode == 0, finished.stderr
    assert plane.requests[0].body["token"] == TOKEN
    output = plane.lines("stdout")
    assert not any(line.startswith("CORRAL_REGISTRATION_TOKEN") for line in output)
    assert str(read_end) not in output  # the pipe was closed, not inherited by the step


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK),
    reason="runs the runner as another user (needs root) with the system's python3",
)
def test_a_step_of_the_same_user_cannot_read_the_runners_memory_or_environment(
    control_plane: PlaneFactory,
) -> None:
    """The runner and its work run as one unprivileged user: the work scans the runner's
    /proc files and finds them closed (the runner is not dumpable), and no token."""
    plane = control_plane(shell(f"python3 -c {shlex.quote(SCANNER)} $PPID"), unix=True)
    workdir = Path(tempfile.mkdtemp(prefix="crl-work-", dir="/tmp"))
    os.chown(workdir, 10001, 10001)
    socket_dir = Path(plane.url.removeprefix("unix://")).parent
    os.chmod(socket_dir, 0o755)
    os.chmod(socket_dir / "api.sock", 0o666)
    try:
        finished = run_runner(plane, workdir, user=10001, python="/usr/bin/python3")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    assert finished.returncode == 0, finished.stderr
    [scanned] = [line for line in plane.lines("stdout") if line.startswith("scanned")]
    assert "-m runner" in scanned, scanned  # it is the runner that was scanned
    assert "environ=denied mem=denied" in scanned, scanned
    assert not [line for line in plane.lines("stdout") if line.startswith("found")]
    assert "scan done" in plane.lines("stdout")


def test_pre_release_runs_after_complete(control_plane: PlaneFactory, tmp_path: Path) -> None:
    plane = control_plane(
        shell("echo work", pre_release=["echo releasing", "exit 7", "touch released"])
    )

    finished = run_runner(plane, tmp_path)

    assert finished.returncode == 0, finished.stderr  # a failing pre_release changes nothing
    assert plane.completion()["exit_code"] == 0
    assert (tmp_path / "released").exists()
    paths = plane.paths()
    completed_at = paths.index("/v1/runner/complete")
    later = [r.body for r in plane.requests[completed_at + 1 :] if r.path == "/v1/runner/logs"]
    assert any(entry["line"] == "releasing" for body in later for entry in body["lines"])


def test_overlong_lines_are_cut(control_plane: PlaneFactory, tmp_path: Path) -> None:
    plane = control_plane(shell("head -c 20000 /dev/zero | tr '\\0' x; echo; echo next"))

    run_runner(plane, tmp_path)

    long_line, following = plane.lines("stdout")
    assert len(long_line.encode()) <= MAX_LINE_BYTES
    assert long_line.startswith("x" * 1000)
    assert following == "next"


def test_truncate_keeps_short_lines_and_marks_cut_ones() -> None:
    assert truncate("short") == "short"
    cut = truncate("é" * 10_000)
    assert len(cut.encode()) <= MAX_LINE_BYTES
    assert cut.endswith("[truncated]")


def test_log_shipper_batches_in_order_and_survives_failures() -> None:
    sent: list[list[dict[str, Any]]] = []
    shipper = LogShipper(sent.append, interval_s=60, batch_size=200)
    for number in range(450):
        shipper.emit("stdout", str(number))
    shipper.close()
    assert [len(batch) for batch in sent] == [200, 200, 50]
    assert [entry["line"] for batch in sent for entry in batch] == [str(n) for n in range(450)]

    calls: list[int] = []

    def failing(lines: list[dict[str, Any]]) -> None:
        calls.append(len(lines))
        raise ConnectionError("down")

    broken = LogShipper(failing, interval_s=60)
    broken.emit("stdout", "lost")
    broken.close()  # does not raise
    assert calls == [1, 1]  # retried once, then dropped


def test_the_last_batch_is_taken_for_the_report_and_those_before_it_posted_in_order() -> None:
    sent: list[list[dict[str, Any]]] = []
    shipper = LogShipper(sent.append, interval_s=60, batch_size=200)
    for number in range(450):
        shipper.emit("stdout", str(number))

    final = shipper.take_final()

    assert [len(batch) for batch in sent] == [200, 200]
    lines = [entry["line"] for batch in [*sent, final] for entry in batch]
    assert lines == [str(n) for n in range(450)]
    assert shipper.take_final() == []  # taken once
    shipper.close()
    assert len(sent) == 2  # nothing left to post

    # A last batch too large to ride with the report (whose body holds the result too) is
    # posted on its own.
    big = LogShipper(sent.append, interval_s=60, batch_size=200)
    for _ in range(10):
        big.emit("stdout", "x" * 8000)
    assert big.take_final(max_bytes=64 * 1024) == []
    assert len(sent) == 3 and len(sent[2]) == 10
    assert big.take_final() == []

    spent = LogShipper(lambda lines: {"accepted": 0, "dropped": len(lines)}, batch_size=1)
    spent.emit("stdout", "over the budget")
    spent.emit("stdout", "after it")
    assert spent.take_final() == []  # the budget is spent: the report carries nothing


def test_sigterm_to_the_runner_stops_the_work_and_still_reports(
    control_plane: PlaneFactory, tmp_path: Path
) -> None:
    plane = control_plane(shell("echo started; sleep 30", pre_release=["touch released"]))
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(REPO_ROOT),
        "CORRAL_CONTROL_URL": plane.url,
        "CORRAL_REGISTRATION_TOKEN": TOKEN,
    }
    with subprocess.Popen(
        [sys.executable, "-m", "runner"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    ) as process:
        deadline = time.monotonic() + 10
        while "started" not in plane.lines() and time.monotonic() < deadline:
            time.sleep(0.05)
        process.terminate()
        assert process.wait(timeout=10) == 1

    completion = plane.completion()
    assert completion["cancelled"] is True
    assert "SIGTERM" in completion["error"]
    assert not (tmp_path / "released").exists()  # the sandbox is going away: no pre_release
