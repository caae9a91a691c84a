"""Importing the agentrun provider leaves the process's environment alone, and the SDK's
import-time banner (which asks for DISABLE_BREAKING_CHANGES_WARNING) stays quiet."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import logging, os
before = dict(os.environ)
import corral.providers.agentrun
print(dict(os.environ) == before, logging.getLogger("agentrun-logger").filters)
"""


def test_the_import_changes_no_environment_and_prints_no_banner() -> None:
    environ = {k: v for k, v in os.environ.items() if k != "DISABLE_BREAKING_CHANGES_WARNING"}
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=environ, check=True
    )
    assert result.stdout.split() == ["True", "[]"]  # and no filter of ours is left behind
    assert "breaking changes" not in result.stderr + result.stdout
