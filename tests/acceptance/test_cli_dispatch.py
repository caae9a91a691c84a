"""`corral dispatch` through real processes: through `corral dev`'s api, its output streamed
and its exit status the work's own or corral's (123, 124, 125); and a dispatch that reports
failure, through an api or a broker it cannot reach, leaves no item behind, while sending it
again with its idempotency key runs it once."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from queue import Empty, Queue
from typing import Any

import pytest
import redis

from corral.cli.output import EXIT_FAILED_WITHOUT_CODE, EXIT_NOT_DISPATCHED, EXIT_WAIT_TIMEOUT
from tests.acceptance.dev_process import DevProcess, running_dev
from tests.acceptance.stack import CORRAL, REPO, Stack, free_port

SECRET = "an-env-value-never-shown"
DISPATCH = ["dispatch", "--org", "acme", "--project", "web", "--network"]


@pytest.fixture(scope="module")
def dev() -> Iterator[DevProcess]:
    with running_dev() as running:
        running.setup_pool()
        yield running


def key_of(stderr: str) -> str:
    found = re.search(r"^idempotency key: (\S+)$", stderr, re.M)
    assert found, stderr
    return found.group(1)


def items_with_key(
    request: Callable[[str, str], tuple[int, Any]], org: str, key: str
) -> list[dict[str, Any]]:
    status, body = request("GET", f"/v1/work-items?org={org}&idempotency_key={key}")
    assert status == 200, body
    return list(body["items"])


def test_wait_exits_with_the_works_own_code_and_prints_its_output(dev: DevProcess) -> None:
    done = dev.corral(*DISPATCH, "--wait", "--", "echo out; echo err >&2; exit 7")
    assert done.returncode == 7, done.stderr
    item_id, output = done.stdout.splitlines()
    assert item_id.startswith("wi-") and output == "out"
    assert "err" in done.stderr.splitlines()
    assert "] failed exit 7" in done.stderr


def test_wait_streams_the_output_while_the_work_runs(dev: DevProcess) -> None:
    lines: Queue[str] = Queue()
    with subprocess.Popen(
        [*CORRAL, *DISPATCH, "--wait", "--", "echo first; sleep 120"],
        env=dev.env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as process:
        reader = threading.Thread(target=lambda: [lines.put(line) for line in process.stdout or []])
        reader.start()
        try:
            item_id = lines.get(timeout=60).strip()
            assert lines.get(timeout=60).strip() == "first"  # printed while the work sleeps
            view = dev.request("GET", f"/v1/work-items/{item_id}")[1]
            assert view["state"] == "running", view
            assert dev.corral("cancel", item_id).returncode == 0
            assert process.wait(timeout=60) == EXIT_FAILED_WITHOUT_CODE  # cancelled: no code
        finally:
            if process.poll() is None:
                process.kill()
        reader.join(timeout=10)
    with pytest.raises(Empty):
        lines.get_nowait()


def test_a_timeout_a_dispatch_error_and_a_failure_without_a_code_have_their_own_codes(
    dev: DevProcess,
) -> None:
    timed_out = dev.corral(*DISPATCH, "--wait", "--timeout", "1", "--", "sleep 120")
    assert timed_out.returncode == EXIT_WAIT_TIMEOUT, timed_out.stderr
    item_id = timed_out.stdout.splitlines()[0]
    assert f"{item_id} is still" in timed_out.stderr and "it goes on" in timed_out.stderr
    still = dev.request("GET", f"/v1/work-items/{item_id}")[1]["state"]
    assert still in ("routed", "provisioning", "awaiting_claim", "running"), still
    dev.corral("cancel", item_id)
    unknown = dev.corral(*DISPATCH, "--profile", "nosuch", "--wait", "--", "true")
    assert unknown.returncode == EXIT_NOT_DISPATCHED, unknown.stderr
    assert "is a dispatch error, unknown_profile" in unknown.stderr
    install = dev.corral(*DISPATCH, "--install", "exit 3", "--wait", "--", "true")
    assert install.returncode == EXIT_FAILED_WITHOUT_CODE, install.stderr
    assert "install_failed" in install.stderr


def test_the_whole_message_from_standard_input_with_flags_over_it(dev: DevProcess) -> None:
    message = {
        "org": "acme",
        "project": "from-file",
        "profile": "default",
        "work": {"kind": "shell", "command": "echo ${#GREETING} $PROJECT_NAME"},
        "env": {"PROJECT_NAME": "file"},
        "egress": {"allow_network": True},
    }
    flags = ["--project", "web", "--env", f"GREETING={SECRET}", "--env", "PROJECT_NAME=flag"]
    done = dev.corral(
        "dispatch",
        "--message",
        "-",
        *flags,
        "--wait",
        "--format",
        "json",
        stdin=json.dumps(message),
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert (record["project"], record["state"]) == ("web", "succeeded")
    stdout = [line for line in record["logs"] if line.startswith("[stdout]")]
    assert stdout == [f"[stdout] {len(SECRET)} flag"]
    assert SECRET not in done.stdout + done.stderr


def test_a_message_the_api_refuses_is_not_dispatched_and_its_values_are_not_shown(
    dev: DevProcess,
) -> None:
    message = {"org": "acme", "project": "web", "work": {"kind": "shell", "command": "true"}}
    flags = ["--env", f"LD_PRELOAD={SECRET}"]
    done = dev.corral("dispatch", "--message", "-", *flags, stdin=json.dumps(message))
    assert done.returncode == EXIT_NOT_DISPATCHED, done.stderr
    assert "refused it: invalid dispatch: env: LD_PRELOAD is refused" in done.stderr
    assert SECRET not in done.stdout + done.stderr
    assert items_with_key(dev.request, "acme", key_of(done.stderr)) == []


def test_a_dispatch_through_a_killed_devs_api_says_so_and_leaves_nothing() -> None:
    with running_dev() as gone:
        url = gone.api_url
        gone.kill()  # SIGKILL: its api-url file stays behind
        assert (gone.state_dir / "api-url").read_text().strip() == url
        failed = gone.corral(*DISPATCH, "--", "true")
        assert failed.returncode == EXIT_NOT_DISPATCHED, failed.stderr
        assert "left by a `corral dev` that no longer runs: start it again" in failed.stderr
        again = DevProcess(gone.state_dir).start()
        try:
            assert items_with_key(again.request, "acme", key_of(failed.stderr)) == []
        finally:
            again.kill()


def test_a_dispatch_the_api_never_got_leaves_no_item_and_a_retry_runs_once(
    dev: DevProcess,
) -> None:
    down = {**dev.env, "CORRAL_API_URL": f"http://127.0.0.1:{free_port()}"}
    failed = dev.corral(*DISPATCH, "--wait", "--", "echo once", env=down)
    assert failed.returncode == EXIT_NOT_DISPATCHED, failed.stderr
    assert "did not answer" in failed.stderr and "Traceback" not in failed.stderr
    key = key_of(failed.stderr)
    assert items_with_key(dev.request, "acme", key) == []
    again = ["--idempotency-key", key]
    retried = dev.corral(*DISPATCH, *again, "--wait", "--", "echo once")
    assert retried.returncode == 0, retried.stderr
    item_id, output = retried.stdout.splitlines()
    assert output == "once"
    third = dev.corral(*DISPATCH, *again, "--", "echo once")
    assert third.returncode == 0 and third.stdout.strip() == item_id
    assert f"an earlier dispatch with this key made {item_id}" in third.stderr
    [item] = items_with_key(dev.request, "acme", key)
    assert item["id"] == item_id
    assert dev.request("GET", f"/v1/work-items/{item_id}")[1]["attempts"] == 1


def test_a_dispatch_through_a_broker_it_cannot_reach_leaves_nothing_and_a_retry_runs_once(
    stack: Stack,
) -> None:
    org = stack.make_org(f"cli-{uuid.uuid4().hex[:8]}")
    no_api = {**stack.env, "CORRAL_API_PORT": str(free_port())}  # a stack without an api
    unreachable = {**no_api, "CORRAL_BROKER_URL": "redis://127.0.0.1:1/0"}
    command = [*CORRAL, "dispatch", "--org", org, "--project", "web", "--network"]

    def corral(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*command, *args],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    failed = corral("--wait", "--", "echo once", env=unreachable)
    assert failed.returncode == EXIT_NOT_DISPATCHED, failed.stderr
    said = failed.stderr.strip().splitlines()
    assert "cannot use the broker at redis://127.0.0.1:1/0 (CORRAL_BROKER_URL)" in said[-1]
    assert "Traceback" not in failed.stderr
    key = key_of(failed.stderr)
    assert items_with_key(stack.request, org, key) == []
    queue = f"{stack.key_prefix}dispatch"
    assert redis.Redis.from_url(stack.broker_url).llen(queue) == 0  # nothing waits to run
    retried = corral("--idempotency-key", key, "--wait", "--", "echo once", env=no_api)
    assert retried.returncode == 0, retried.stderr
    assert "sending through the broker" in retried.stderr
    item_id, output = retried.stdout.splitlines()
    assert output == "once"
    third = corral("--idempotency-key", key, "--", "echo once", env=no_api)
    assert third.returncode == 0 and third.stdout.strip() == item_id, third.stderr
    [item] = items_with_key(stack.request, org, key)
    assert item["id"] == item_id
    assert stack.request("GET", f"/v1/work-items/{item_id}")[1]["attempts"] == 1
