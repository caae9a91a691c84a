"""``corral logs`` on a terminal: the work's control characters are shown escaped, never
sent raw (an OSC 52 sequence would write the operator's clipboard); ``--raw`` sends them as
they are, and so does a pipe. The command runs as a real process on a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from corral.cli.app import app
from corral.shared import runtime
from corral.shared.store.db import Database, make_engine
from corral.shared.store.lifecycle import transition
from corral.shared.store.models import ItemState, WorkItem, WorkItemLog
from tests.seeding import received_item

# What a tenant's work printed: a clipboard write (OSC 52, BEL-terminated), a screen clear
# (CSI), a carriage return that would hide what came before it, and C1's CSI.
CLIPBOARD = "\x1b]52;c;ZWNobyBwd25lZA==\x07"
HOSTILE = f"before{CLIPBOARD}\x1b[2J\rhidden\x9b31m after\ttab"
SHOWN = r"before\x1b]52;c;ZWNobyBwd25lZA==\x07\x1b[2J\x0dhidden\x9b31m after" + "\ttab"
RAW_CONTROLS = (b"\x1b", b"\x07", b"\r\x68idden", b"\xc2\x9b")  # ESC, BEL, CR, C1 CSI
PROCESS_TIMEOUT_S = 60


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for name, value in environment(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CORRAL_DATABASE_URL", raising=False)
    yield tmp_path
    runtime.reset()


def environment(state_dir: Path) -> dict[str, str]:
    return {
        "CORRAL_STATE_DIR": str(state_dir),
        "CORRAL_BROKER_URL": "memory://",
        "CORRAL_API_URL": "http://127.0.0.1:9",  # no corral dev answers here
    }


def invoke(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture
def item_with_hostile_log(state_dir: Path) -> str:
    """An ended item whose log holds HOSTILE on stdout and on stderr."""
    invoke("profiles", "create", "--name", "default", "--model", "m", "--auth-mode", "byok")
    invoke("pools", "create", "--org", "acme", "--name", "local", "--provider", "local")
    database = Database(make_engine(f"sqlite:///{state_dir / 'corral.db'}"))
    item_id = received_item(database, "acme", "true")
    with database.session() as session:
        session.add(WorkItemLog(work_item_id=item_id, stream="stdout", line=HOSTILE))
        session.add(WorkItemLog(work_item_id=item_id, stream="stderr", line=HOSTILE))
        item = session.get(WorkItem, item_id)
        assert item is not None
        transition(session, item, ItemState.CANCELLED, actor="test")
    database.dispose()
    return item_id


def on_terminal(state_dir: Path, *args: str) -> bytes:
    """What ``corral ARGS`` writes to a pseudo-terminal (its stdout and stderr both)."""
    controller, terminal = pty.openpty()
    env = {**os.environ, **environment(state_dir)}
    env.pop("CORRAL_DATABASE_URL", None)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "corral", *args],
            stdin=subprocess.DEVNULL,
            stdout=terminal,
            stderr=terminal,
            env=env,
        )
    finally:
        os.close(terminal)
    written = bytearray()
    try:
        while chunk := _read(controller):
            written += chunk
    finally:
        os.close(controller)
    assert process.wait(timeout=PROCESS_TIMEOUT_S) == 0, bytes(written)
    return bytes(written)


def _read(controller: int) -> bytes:
    try:
        return os.read(controller, 65536)
    except OSError:  # EIO: every writer of the terminal has closed it
        return b""


def test_logs_on_a_terminal_show_control_characters_escaped(
    state_dir: Path, item_with_hostile_log: str
) -> None:
    written = on_terminal(state_dir, "logs", item_with_hostile_log)
    for control in RAW_CONTROLS:
        assert control not in written, (control, written)
    assert written.count(SHOWN.encode()) == 2, written  # stdout's line and stderr's


def test_logs_raw_on_a_terminal_pass_the_bytes_through(
    state_dir: Path, item_with_hostile_log: str
) -> None:
    written = on_terminal(state_dir, "logs", "--raw", item_with_hostile_log)
    assert written.count(CLIPBOARD.encode()) == 2, written


def test_logs_into_a_pipe_keep_the_bytes_as_the_work_wrote_them(
    state_dir: Path, item_with_hostile_log: str
) -> None:
    env = {**os.environ, **environment(state_dir)}
    env.pop("CORRAL_DATABASE_URL", None)
    piped = subprocess.run(
        [sys.executable, "-m", "corral", "logs", item_with_hostile_log],
        capture_output=True,
        env=env,
        timeout=PROCESS_TIMEOUT_S,
        check=True,
    )
    assert piped.stdout == HOSTILE.encode() + b"\n"
    assert piped.stderr == HOSTILE.encode() + b"\n"


def test_show_on_a_terminal_shows_the_log_escaped(
    state_dir: Path, item_with_hostile_log: str
) -> None:
    written = on_terminal(state_dir, "show", item_with_hostile_log)
    for control in RAW_CONTROLS:
        assert control not in written, (control, written)
    assert written.count(SHOWN.encode()) == 2, written
