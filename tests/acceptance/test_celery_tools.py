"""Celery's own tools on a running corral: ``celery -A corral …`` finds the deployment's
broker and key prefix, and a worker it starts logs as corral's processes do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from corral.shared.broker import celery_app
from corral.shared.settings import CoreSettings
from tests.acceptance.stack import Stack
from tests.conftest import require_bwrap_path

CELERY = [sys.executable, "-m", "celery", "-A", "corral"]


@pytest.fixture(scope="module")
def maintenance_only(postgres_database_url: str, redis_url: str) -> Iterator[Stack]:
    """A stack whose only Celery worker is the maintenance worker: nothing consumes
    ``provision.local``, so what is sent there waits for ``purge``."""
    require_bwrap_path()
    running = Stack(database_url=postgres_database_url, broker_url=redis_url)
    try:
        yield running.start_only(["api", "maintenance"])
    finally:
        running.stop()


def _sender(stack: Stack) -> Celery:
    return celery_app.configure(
        CoreSettings(broker_url=stack.broker_url, broker_key_prefix=stack.key_prefix)
    )


def _celery(stack: Stack, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CELERY, *args],
        env=stack.env,
        cwd=stack.state_dir,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def test_inspect_ping_reaches_the_deployments_workers_under_its_key_prefix(
    maintenance_only: Stack,
) -> None:
    answer = _celery(maintenance_only, "inspect", "ping", "--timeout", "5")
    assert answer.returncode == 0, answer.stderr
    assert "maintenance@" in answer.stdout and "pong" in answer.stdout

    # The same command without the deployment's prefix reaches no worker of it.
    elsewhere = {**maintenance_only.env, "CORRAL_BROKER_KEY_PREFIX": "another-deployment:"}
    lonely = subprocess.run(
        [*CELERY, "inspect", "ping", "--timeout", "2"],
        env=elsewhere,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert lonely.returncode != 0
    assert "maintenance@" not in lonely.stdout


def test_purge_empties_a_provider_queue_of_the_deployment(maintenance_only: Stack) -> None:
    sender = _sender(maintenance_only)
    for number in range(3):
        sender.send_task("corral.provision", args=[f"wi-purge-{number}"], queue="provision.local")
    client = redis.Redis.from_url(maintenance_only.broker_url)
    key = f"{maintenance_only.key_prefix}provision.local"
    assert client.llen(key) == 3

    answer = _celery(maintenance_only, "purge", "-Q", "provision.local", "-f")

    assert answer.returncode == 0, answer.stderr
    assert "Purged 3 messages" in answer.stdout
    assert client.llen(key) == 0


def test_a_celery_started_worker_logs_corrals_json_lines(maintenance_only: Stack) -> None:
    log_path = Path(maintenance_only.state_dir) / "celery-worker.log"
    command = ["worker", "-Q", "provision.local", "--pool", "threads", "-n", "tools@%h"]
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            [*CELERY, *command, "--loglevel", "INFO"],
            env=maintenance_only.env,
            cwd=maintenance_only.state_dir,
            stdout=subprocess.DEVNULL,  # Celery's banner
            stderr=log,
            start_new_session=True,
        )
    try:
        maintenance_only.until(lambda: b"ready." in log_path.read_bytes(), "the worker's start")
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        status = worker.wait(timeout=60)
    lines = log_path.read_text().splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert any(record["message"].endswith("ready.") for record in records)
    # Celery's own format ("[2026-… INFO/MainProcess] …") is not used for any line.
    assert not [line for line in lines if "INFO/MainProcess]" in line]
    assert status == 0
