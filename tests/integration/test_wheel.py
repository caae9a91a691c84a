"""The wheel holds one top-level package, ``corral``, with the folders its symlinks name as
real files, and its package data. Built with pip (its build dependencies come from the
package index), a few seconds."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("shared", "scheduler", "worker", "providers", "runner")


def test_the_wheel_installs_corral_alone(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    [wheel] = tmp_path.glob("corral-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        [top_level] = [name for name in names if name.endswith(".dist-info/top_level.txt")]
        assert archive.read(top_level).decode().split() == ["corral"]
    outside = [name for name in names if not name.startswith("corral/")]
    assert all(".dist-info/" in name for name in outside), outside
    for folder in FOLDERS:
        expected = {
            f"corral/{path.relative_to(ROOT).as_posix()}"
            for path in (ROOT / folder).rglob("*.py")
            if "__pycache__" not in path.parts
        }
        assert expected <= set(names), sorted(expected - set(names))
    assert "corral/py.typed" in names
    assert "corral/shared/store/migrations/script.py.mako" in names
    assert "corral/runner/node_bootstrap.js" in names  # javascript code items need it
    console = ROOT / "scheduler" / "console"  # the web console's pages and their script
    for path in [*console.glob("templates/*.html"), *console.glob("static/*")]:
        assert f"corral/{path.relative_to(ROOT).as_posix()}" in names
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
