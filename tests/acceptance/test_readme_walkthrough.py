"""The README's walkthrough, run as written: every command of its shell block, in one bash
session (with ``set -e``), on a fresh state directory, with `corral dev` in the background."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from sqlalchemy import select

from corral.shared.store.db import make_engine
from corral.shared.store.models import LifecycleEvent
from tests.acceptance.stack import REPO
from tests.acceptance.test_dev_demo import clean_env


def walkthrough_commands(readme: str) -> list[str]:
    """The commands of the first ``sh`` block after the ``## Walkthrough`` heading."""
    section = readme.split("\n## Walkthrough\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert found, "the README's walkthrough has no sh block"
    return [line for line in found.group(1).splitlines() if line.strip()]


def test_the_walkthrough_is_a_few_commands_that_start_and_stop_corral_dev() -> None:
    commands = walkthrough_commands((REPO / "README.md").read_text())
    assert commands[0] == ". .venv/bin/activate"
    assert commands[1] == "corral dev &"
    assert commands[-1] == "kill %1"


def run_walkthrough(commands: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    # Each command's trace line (bash -x) says when it started (bash reads no PS4 from the
    # environment of a root shell: it is set in the script).
    script = "\n".join(["PS4='+ $EPOCHREALTIME '", "set -euo pipefail", *commands, "wait"])
    process = subprocess.Popen(
        ["bash", "-x", "-c", script],
        cwd=REPO,
        env=clean_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # corral dev and its sandboxes: stopped with it below
    )
    try:
        stdout, stderr = process.communicate(timeout=240)
    finally:
        if process.poll() is None or process.returncode != 0:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.alone  # a bound in wall-clock time: not beside the parallel suite's load
def test_every_command_of_the_readme_walkthrough_succeeds(tmp_path: Path) -> None:
    commands = walkthrough_commands((REPO / "README.md").read_text())
    done = run_walkthrough(commands, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "corral dev: api on http://127.0.0.1:" in out
    assert re.search(r"^console: http://127\.0\.0\.1:\d+/console ", out, re.M)
    assert "hello from corral" in out.splitlines()  # the item's output, on a line of its own
    assert "succeeded exit 0" in done.stderr  # the progress line of its end
    assert "acme  web      succeeded  local" in out  # items list: the pool's name
    assert "processes (Celery inspect" in out and "work items by state" in out
    curl_answer = next(line for line in out.splitlines() if line.startswith('{"pools"'))
    [pool] = json.loads(curl_answer)["pools"]
    assert (pool["name"], pool["org_id"]) == ("local", "acme")
    state = tmp_path / ".local" / "state" / "corral"
    assert (state / "admin-token").stat().st_mode & 0o777 == 0o600
    assert not (state / "api-url").exists()  # corral dev took it away when it stopped
    # The dispatch went through corral dev's api, which routed the item as it took it (a
    # re-drive, the maintenance worker's, would have taken CORRAL_REDRIVE_INTERVAL_S): within
    # a second of the command's start, its own start-up included. The start is bash's, as it
    # starts the command (its trace line); the routing is the api's event: one clock. Most
    # of the second is the CLI's start-up (about 0.2 s of CPU), which a loaded machine
    # stretches: the message says the load (docs/benchmarks.md: figures idle and loaded).
    started = command_start(done.stderr, "corral dispatch ")
    accepted, routed, actor = routing_of(state / "corral.db")
    assert actor == "api", f"routed by {actor}, not at intake"
    print(f"routed {routed - started:.2f} s after `corral dispatch` started")
    assert routed - started < 1.0, (
        f"routed {routed - started:.2f} s after `corral dispatch` started, "
        f"{routed - accepted:.2f} s after the api accepted it; 1-minute load "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )


def command_start(trace: str, command: str) -> float:
    """When the walkthrough's ``command`` started, from its bash -x trace line."""
    found = re.search(rf"^\+ (\d+\.\d+) {re.escape(command)}", trace, re.M)
    assert found, trace
    return float(found.group(1))


def routing_of(database: Path) -> tuple[float, float, str]:
    """When the one work item of the database was accepted and routed, and by whom (its
    lifecycle events)."""
    engine = make_engine(f"sqlite:///{database}")
    try:
        with engine.connect() as connection:
            events = connection.execute(
                select(LifecycleEvent.to_state, LifecycleEvent.created_at, LifecycleEvent.actor)
                .where(LifecycleEvent.entity == "work_item")
                .where(LifecycleEvent.to_state.in_(["received", "routed"]))
            ).all()
    finally:
        engine.dispose()
    at = {state: (when.timestamp(), actor) for state, when, actor in events}
    return at["received"][0], at["routed"][0], at["routed"][1]
