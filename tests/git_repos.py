"""Git repositories made on the spot for tests: no network, no credentials."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def git(*args: str, cwd: Path) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True)
    return done.stdout.strip()


def bare_repository(root: Path) -> tuple[Path, str]:
    """``root/served/repo.git``, a bare repository whose main holds a.txt, b.txt and c.txt
    (``<name> one``, ``<name> two``): its path and its commit."""
    if shutil.which("git") is None:
        pytest.fail("git is not installed")
    source = root / "source"
    source.mkdir()
    git("init", "-q", "-b", "main", cwd=source)
    for name in ("a", "b", "c"):
        (source / f"{name}.txt").write_text(f"{name} one\n{name} two\n")
    git("add", ".", cwd=source)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "base", cwd=source)
    bare = root / "served" / "repo.git"
    git("clone", "-q", "--bare", str(source), str(bare), cwd=root)
    return bare, git("rev-parse", "HEAD", cwd=source)
