"""The alert rules beside the dashboard (deploy/prometheus/corral-alerts.yaml): valid for
``promtool check rules``, each alert fired on a made-up series by ``promtool test rules``,
and every metric they read one that corral exports. promtool is required in CI (the
``prometheus`` package); elsewhere its tests skip."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from corral.shared.store.db import Database
from tests.conftest import require
from tests.unit.test_outcomes import exported_metric_names

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "corral-alerts.yaml"
RULE_TESTS = RULES.with_name("corral-alerts.test.yaml")


def promtool() -> str:
    path = shutil.which("promtool")
    require(path is not None, "promtool (apt-get install prometheus)")
    assert path is not None
    return path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args],
        check=False,
        cwd=RULES.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )


def alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_finds_the_rules_valid() -> None:
    checked = run("check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in checked.stdout


def test_each_alert_fires_on_a_made_up_series() -> None:
    tested = run("test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {
        check["alertname"]
        for case in cases
        for check in case["alert_rule_test"]
        if check["exp_alerts"]
    }
    assert fired == {rule["alert"] for rule in alerts()}


def test_the_rules_read_only_metrics_corral_exports(sqlite_db: Database) -> None:
    # Every metric the processes serve is registered on import.
    import corral.scheduler.api.app
    import corral.worker.tasks  # noqa: F401

    used = {name for rule in alerts() for name in re.findall(r"\bcorral_[a-z0-9_]+", rule["expr"])}
    exported = exported_metric_names(sqlite_db)
    assert used - exported == set()
    assert {
        "corral_pool_breaker_open",
        "corral_dispatch_errors_total",
        "corral_queue_consumers",
        "corral_queue_messages",
        "corral_budget_spend_ratio",
        "corral_reaper_last_sweep_timestamp_seconds",
        "corral_intake_last_progress_timestamp_seconds",
    } <= used
