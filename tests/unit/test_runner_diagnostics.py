"""The runner's own diagnostics: ``corral-runner: LEVEL message`` lines, redacted, and a
start-up that does not pay for the standard library's ``logging``."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from corral.runner import diagnostics
from corral.runner.diagnostics import RunnerLogger, configure_logging, redact

RUNNER_PACKAGE = Path(diagnostics.__file__).resolve().parent


def sandbox_python(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -S`` with a copy of the runner package importable as top-level ``runner``,
    as a local sandbox runs it (the provider's PYTHONPATH names the copy's parent)."""
    lib = tmp_path / "lib"
    shutil.copytree(RUNNER_PACKAGE, lib / "runner", ignore=shutil.ignore_patterns("__pycache__"))
    return subprocess.run(
        [sys.executable, "-S", *args],
        cwd=tmp_path,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(lib)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_importing_the_runner_does_not_import_logging(tmp_path: Path) -> None:
    code = "import sys, runner.main; print('logging' in sys.modules)"
    finished = sandbox_python(tmp_path, "-c", code)
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.strip() == "False"


def test_a_runner_that_cannot_start_says_why_on_stderr_in_its_format(tmp_path: Path) -> None:
    finished = sandbox_python(tmp_path, "-m", "runner")
    assert finished.returncode == 2  # EXIT_CONFIGURATION
    assert finished.stderr == "corral-runner: ERROR CORRAL_CONTROL_URL is not set\n"


def test_configured_lines_are_info_and_above_formatted_and_redacted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(diagnostics, "logger", RunnerLogger())
    stream = io.StringIO()
    configure_logging(stream)
    diagnostics.logger.info("waiting %.1f s", 2)
    diagnostics.logger.warning("heartbeat failed: %s", "HTTP 401 for crs_secret.value")
    diagnostics.logger.error("100% done")  # no arguments: not %-formatted, as logging does
    assert stream.getvalue() == (
        "corral-runner: INFO waiting 2.0 s\n"
        "corral-runner: WARNING heartbeat failed: HTTP 401 for crs_<redacted>\n"
        "corral-runner: ERROR 100% done\n"
    )


def test_exception_appends_the_traceback_redacted() -> None:
    logger, stream = RunnerLogger(), io.StringIO()
    logger.configure(stream)

    def fail() -> None:
        raise ValueError("rejected crt_registration-secret")

    try:
        fail()
    except ValueError:
        logger.exception("the runner failed while running %s", "the work item")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "corral-runner: ERROR the runner failed while running the work item"
    assert lines[1] == "Traceback (most recent call last):"
    assert any("in fail" in line for line in lines)
    assert lines[-1] == "ValueError: rejected crt_<redacted>"
    assert "registration-secret" not in stream.getvalue()


def test_before_configuration_warnings_and_errors_go_to_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logger = RunnerLogger()
    logger.info("not shown")
    logger.warning("shown %d", 1)
    assert capsys.readouterr().err == "corral-runner: WARNING shown 1\n"


def test_a_closed_stream_never_fails_the_runner() -> None:
    logger, stream = RunnerLogger(), io.StringIO()
    logger.configure(stream)
    stream.close()
    logger.error("lost")  # no exception


def test_redact_keeps_the_prefix_of_every_token_kind() -> None:
    text = "crt_a crs_b.c cre_d crw_e/f= crx_kept xcrt_kept"
    assert redact(text) == (
        "crt_<redacted> crs_<redacted> cre_<redacted> crw_<redacted> crx_kept xcrt_kept"
    )
