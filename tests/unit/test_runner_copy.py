"""The runner package local sandboxes import: copied under the sandbox root and compiled
once (providers/local/runner_copy.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from corral.providers.local.runner_copy import (
    COPIES_DIR,
    STALE_STAGING_S,
    compiled_copy,
    package_digest,
)


def _package(tmp_path: Path) -> Path:
    package = tmp_path / "src" / "runner"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "main.py").write_text("VALUE = 1\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "bootstrap.js").write_text("// not python\n")
    return package


def test_the_copy_holds_every_file_and_the_bytecode_of_every_module(tmp_path: Path) -> None:
    package = _package(tmp_path)
    copy = compiled_copy(package, tmp_path / "root")

    assert copy.parent.parent == tmp_path / "root" / COPIES_DIR and copy.name == "runner"
    assert (copy / "bootstrap.js").read_text() == "// not python\n"
    for module in ("__init__", "main"):
        assert list((copy / "__pycache__").glob(f"{module}.*.pyc")), module
    assert list((copy / "sub" / "__pycache__").glob("__init__.*.pyc"))
    assert not list(package.rglob("*.pyc"))  # the package as installed is left alone
    modes = {path.stat().st_mode & 0o777 for path in copy.rglob("*")}
    assert modes <= {0o755, 0o644}  # whoever a sandbox runs as reads it


def test_the_copy_is_made_once_per_content(tmp_path: Path) -> None:
    package = _package(tmp_path)
    root = tmp_path / "root"
    first = compiled_copy(package, root)
    marker = first / "main.py"
    stamp = marker.stat().st_mtime_ns

    assert compiled_copy(package, root) == first
    assert marker.stat().st_mtime_ns == stamp  # not made again

    (package / "main.py").write_text("VALUE = 2\n")
    changed = compiled_copy(package, root)
    assert changed != first and package_digest(package) in str(changed)
    assert (changed / "main.py").read_text() == "VALUE = 2\n"
    assert not list((root / COPIES_DIR / first.parent.name).glob(".making-*"))


def test_a_root_that_is_a_file_falls_back_to_the_package_as_installed(tmp_path: Path) -> None:
    package = _package(tmp_path)
    root = tmp_path / "root"
    root.write_text("not a directory")
    assert compiled_copy(package, root) == package


def test_what_a_maker_killed_mid_copy_left_is_removed_by_the_next_maker(tmp_path: Path) -> None:
    package = _package(tmp_path)
    root = tmp_path / "root"
    place = root / COPIES_DIR / package_digest(package)
    left = place / ".making-killed" / "runner"  # a maker SIGKILLed mid-copy
    left.mkdir(parents=True)
    (left / "main.py").write_text("VALUE = 1\n")
    long_ago = time.time() - STALE_STAGING_S - 60
    os.utime(place / ".making-killed", (long_ago, long_ago))
    at_work = place / ".making-now"  # another maker, copying at this moment
    at_work.mkdir()

    copy = compiled_copy(package, root)

    assert copy == place / "runner" and (copy / "main.py").is_file()
    assert sorted(path.name for path in place.iterdir()) == [".making-now", "runner"]
