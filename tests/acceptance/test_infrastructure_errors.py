"""A database or broker that is out of reach or refuses corral: every command and process
ends with one line naming the setting and the address (never the password), non-zero, and
no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.acceptance.stack import REPO, free_port

PASSWORD = "pw-not-to-be-shown-7d1e"
COMMANDS = {
    "status": ["status"],
    "scheduler": ["scheduler"],
    "maintenance worker": ["worker", "--maintenance"],
    "api": ["api"],
}


def _misconfigurations(database: str) -> dict[str, tuple[dict[str, str], str, str]]:
    """name: (settings, the setting the line must name, the address it must give)."""
    closed = free_port()
    return {
        "database refused": (
            {"CORRAL_DATABASE_URL": f"postgresql+psycopg://corral:{PASSWORD}@127.0.0.1:{closed}/x"},
            "CORRAL_DATABASE_URL",
            f"127.0.0.1:{closed}",
        ),
        "database role unknown": (
            {
                "CORRAL_DATABASE_URL": "postgresql+psycopg://"
                f"no_such_role:{PASSWORD}@127.0.0.1:5432/test"
            },
            "CORRAL_DATABASE_URL",
            "127.0.0.1:5432",
        ),
        "redis refused": (
            {
                "CORRAL_DATABASE_URL": database,
                "CORRAL_BROKER_URL": f"redis://:{PASSWORD}@127.0.0.1:{closed}/0",
            },
            "CORRAL_BROKER_URL",
            f"127.0.0.1:{closed}",
        ),
        "rabbitmq password wrong": (
            {
                "CORRAL_DATABASE_URL": database,
                "CORRAL_BROKER_URL": f"amqp://guest:{PASSWORD}@127.0.0.1:5672//",
            },
            "CORRAL_BROKER_URL",
            "127.0.0.1:5672",
        ),
        "rabbitmq vhost missing": (
            {
                "CORRAL_DATABASE_URL": database,
                "CORRAL_BROKER_URL": "amqp://guest:guest@127.0.0.1:5672/no-such-vhost-corral",
            },
            "CORRAL_BROKER_URL",
            "no-such-vhost-corral",
        ),
    }


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_misconfiguration_is_one_line_naming_the_setting(
    command: str, postgres_database_url: str, tmp_path: Path
) -> None:
    for name, (settings, setting, address) in _misconfigurations(postgres_database_url).items():
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "CORRAL_STATE_DIR": str(tmp_path / name.replace(" ", "-")),
            "CORRAL_BROKER_URL": "redis://127.0.0.1:6379/0",
            "CORRAL_BROKER_START_TIMEOUT_S": "1",
            "CORRAL_API_PORT": str(free_port()),
            **settings,
        }
        done = subprocess.run(
            [sys.executable, "-m", "corral", *COMMANDS[command]],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        output = done.stdout + done.stderr
        said = f"{command}, {name}: {output[-2000:]}"
        assert done.returncode == 3, said
        assert "Traceback" not in output, said
        assert PASSWORD not in output, said
        if command == "status" and setting == "CORRAL_BROKER_URL":
            # status shows the whole deployment; the broker's part says why it is missing
            line = next(line for line in done.stdout.splitlines() if "did not answer" in line)
            assert line.strip().startswith("the broker at "), said
        else:
            line = done.stderr.strip().splitlines()[-1]
            assert line.startswith("error: cannot use the "), said
        assert setting in line and address in line, said
