"""`corral api --host --port`: the options beat the settings, and the api says where it
listens (its port, its socket, its metrics, its processes) in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.acceptance.stack import REPO, free_port


def test_the_options_choose_the_port_and_the_api_says_where_it_listens(tmp_path: Path) -> None:
    port, unused = free_port(), free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "CORRAL_STATE_DIR": str(tmp_path / "state"),
        "CORRAL_API_PORT": str(unused),  # the option beats it
        "CORRAL_BROKER_URL": "memory://",
    }
    log = tmp_path / "api.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "corral", "api", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        [said] = [line["message"] for line in lines if "listening on" in line["message"]]
        socket = tmp_path / "state" / "run" / "api.sock"
        assert (
            said == f"api listening on http://127.0.0.1:{port} and {socket}, 1 process; metrics off"
        )
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        assert process.wait(timeout=60) == 0
