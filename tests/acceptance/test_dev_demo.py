"""`corral dev --demo`, the embedded default behind `make run`, as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

from sqlalchemy import select

from corral.shared.store.db import make_engine
from corral.shared.store.models import LifecycleEvent, WorkItem
from tests.acceptance.stack import REPO, delete_broker_keys

EXPECTED = {
    "shell command": "succeeded",
    "python code + arguments": "succeeded",
    "needs a GPU": "dispatch_error",
    "failing install step": "failed",
}


def run_demo(env: dict[str, str]) -> str:
    completed = subprocess.run(
        [sys.executable, "-m", "corral", "dev", "--demo"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return completed.stdout


def states(output: str) -> dict[str, str]:
    found = {}
    for line in output.splitlines():
        for name in EXPECTED:
            if line.startswith(name):
                found[name] = line[len(name) :].split()[2]
    return found


def clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
    return {**env, "HOME": str(home), "PYTHONPATH": str(REPO)}


def test_demo_with_nothing_configured_prints_the_expected_table(tmp_path: Path) -> None:
    output = run_demo(clean_env(tmp_path))
    assert states(output) == EXPECTED
    assert '{"sum_of_powers": 14}' in output
    assert "install step 2 failed with exit code 3" in output
    assert "no_eligible_pool: no active pool for org demo-" in output  # the code, then why
    assert "provides requirement gpu; pools considered: local (local)" in output
    assert "web console: `corral dev` serves it at <api URL>/console" in output


def test_demo_runs_on_redis_and_postgresql_when_configured(
    tmp_path: Path, redis_url: str, postgres_database_url: str
) -> None:
    env = clean_env(tmp_path)
    prefix = f"corral-demo-{uuid.uuid4().hex[:8]}:"
    env.update(
        CORRAL_DATABASE_URL=postgres_database_url,
        CORRAL_BROKER_URL=redis_url,
        CORRAL_BROKER_KEY_PREFIX=prefix,
        CORRAL_STATE_DIR=str(tmp_path / "state"),
    )
    try:
        output = run_demo(env)
    finally:
        delete_broker_keys(redis_url, prefix)
    assert states(output) == EXPECTED
    # The embedded worker says it consumes its queues: no demo item was flagged as routed
    # to a queue nobody serves (which would also have failed it as no_worker in time).
    found = re.search(r"no active pool for org (demo-[0-9a-f]+)", output)
    assert found is not None, output
    engine = make_engine(postgres_database_url)
    try:
        with engine.connect() as connection:
            details = connection.scalars(
                select(LifecycleEvent.detail)
                .join(WorkItem, WorkItem.id == LifecycleEvent.work_item_id)
                .where(WorkItem.org_id == found.group(1), LifecycleEvent.to_state == "routed")
            ).all()
    finally:
        engine.dispose()
    assert details and not [detail for detail in details if "unserved_queue" in str(detail)]
