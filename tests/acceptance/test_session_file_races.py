"""Session file transfer against a sandbox that swaps its directories for symbolic links
while the api opens paths in them (real processes: the api, the workers, a bubblewrap
sandbox running as its own user)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral.client import ExecResult, Session
from corral.providers.local.isolation import base_python
from tests.acceptance.stack import Stack

SWAP_S = 25  # how long the sandbox swaps: the test downloads and uploads all that time
SECRET = b"root-only-marker-5d1c0e"
BENIGN = b"inside the work directory\n"

# Run in the sandbox: make d1/ and d2/ (each a real directory holding the files the test
# asks for) and l1 -> <host directory>, l2 -> /proc/self; then exchange each directory
# with its link, atomically (renameat2 RENAME_EXCHANGE), until the time is up.
SWAPPER = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
host_dir, seconds, benign = sys.argv[1], float(sys.argv[2]), sys.argv[3].encode()
pairs = (("d1", "l1", host_dir), ("d2", "l2", "/proc/self"))
for directory, link, target in pairs:
    os.mkdir(directory)
    for name in ("file.txt", "environ"):
        with open(os.path.join(directory, name), "wb") as out:
            out.write(benign)
    os.symlink(target, link)
open("swapping", "w").close()
swaps, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    for directory, link, _ in pairs:
        if libc.renameat2(AT_FDCWD, directory.encode(), AT_FDCWD, link.encode(),
                          RENAME_EXCHANGE) != 0:
            sys.exit("renameat2: " + os.strerror(ctypes.get_errno()))
        swaps += 1
print(swaps)
"""


@pytest.fixture
def host_secret(tmp_path: Path) -> Path:
    """A host directory only root may enter, holding a marker only root may read."""
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    (secret / "file.txt").write_bytes(SECRET)
    (secret / "file.txt").chmod(0o600)
    return secret


def _session(stack: Stack, org: str) -> Session:
    return Session.create(
        stack.api_url,
        stack.admin_token,
        org=org,
        project="p",
        profile="default",
        ready_timeout_s=60,
        poll_interval_s=0.1,
    )


def _call(client: httpx.Client, method: str, url: str, **body: Any) -> tuple[int, bytes]:
    """The answer's status and bytes; status 0 when the api dropped the connection (as
    uvicorn does after a route's unhandled exception)."""
    try:
        answer = client.request(method, url, **body)
    except httpx.TransportError:
        return 0, b""
    return answer.status_code, answer.content


def _race(client: httpx.Client, base: str, round_: int) -> list[tuple[str, int, bytes]]:
    """One round of downloads and uploads through the swapped directories."""
    answers = []
    for path in ("d1/file.txt", "d2/environ"):
        answers.append((f"GET {path}", *_call(client, "GET", f"{base}/files/{path}")))
    for path in (f"d1/up-{round_}.txt", f"d1/sub-{round_}/up.txt"):
        put = _call(client, "PUT", f"{base}/files/{path}", content=b"uploaded")
        answers.append((f"PUT {path}", *put))
    # An exec in a swapped directory: it runs in the sandbox, which enters cwd itself.
    body = {"command": ["cat", "file.txt"], "cwd": "d1"}
    answers.append(("EXEC d1", *_call(client, "POST", f"{base}/exec", json=body)))
    return answers


def test_a_sandbox_swapping_directories_for_links_never_leads_a_transfer_outside(
    stack: Stack, host_secret: Path
) -> None:
    org = stack.make_org("session-file-races")
    box = _session(stack, org)
    swapped: dict[str, Any] = {}

    def swap() -> None:
        box.upload_file(SWAPPER.encode(), "swap.py")
        argv = [base_python(), "swap.py", str(host_secret), str(SWAP_S), BENIGN.decode()]
        swapped["result"] = box.exec(argv, timeout=SWAP_S + 30)

    swapper = threading.Thread(target=swap)
    headers = {"Authorization": f"Bearer {stack.admin_token}"}
    base = f"{stack.api_url}/v1/sessions/{box.id}"
    answers: list[tuple[str, int, bytes]] = []
    try:
        swapper.start()
        with httpx.Client(headers=headers, timeout=30) as client:
            stack.until(
                lambda: client.get(f"{base}/files/swapping").status_code == 200,
                "the sandbox starts swapping",
            )
            started, rounds = time.monotonic(), 0
            while swapper.is_alive():
                answers += _race(client, base, rounds)
                rounds += 1
        swapper.join()
    finally:
        box.close()
    result: ExecResult = swapped["result"]
    assert result.exit_code == 0, result
    assert int(result.stdout) > 1000, "the sandbox swapped all along"
    assert time.monotonic() - started >= 20 and rounds >= 20, rounds
    # Nothing came from outside the work directory, nothing landed outside it, and every
    # refusal was the client's (a 4xx), never the api's own failure.
    # (Counted, never shown: a leak's bytes may be the api's environment.)
    leaked = Counter(call for call, status, content in answers if _leaked(call, status, content))
    failed = Counter(call.split()[0] for call, status, _ in answers if not 0 < status < 500)
    landed = sorted(p.name for p in host_secret.iterdir() if p.name != "file.txt")
    assert (leaked, failed, landed) == (Counter(), Counter(), []), len(answers)
    assert (host_secret / "file.txt").read_bytes() == SECRET
    for method in ("GET", "PUT"):  # the race was seen (refusals), and let calls through
        statuses = {status for call, status, _ in answers if call.startswith(method)}
        assert 200 in statuses and 422 in statuses, (method, statuses)
    # An exec's cwd is entered inside the sandbox alone: the race shows as the command's own
    # failure to enter it (the host directory is not there), never as the host's.
    execs = [(status, content) for call, status, content in answers if call.startswith("EXEC")]
    assert {status for status, _ in execs} == {200}
    codes = {json.loads(content)["exit_code"] == 0 for _, content in execs}
    assert codes == {True, False}, codes


def _leaked(call: str, status: int, content: bytes) -> bool:
    """A download answered with bytes that are not the work directory's file, or an exec
    that read the host's."""
    if call.startswith("EXEC"):
        return SECRET in content
    return call.startswith("GET") and status == 200 and content != BENIGN
