"""The runner package as local sandboxes see it: a copy under the sandbox root, compiled once.

A sandbox's runner starts a fresh interpreter that imports the runner package read-only, so
it can never write bytecode beside it: where the installed package has none (an editable
install, ``PYTHONDONTWRITEBYTECODE``), every runner would compile every module again, some
20 ms of CPU per sandbox. The provider copies the package once per content into
``<root>/.runner/<digest>/runner`` and compiles it there (unchecked hash-based bytecode: the
copy never changes, so an import need not look at its sources), and binds that copy.

Only the host writes the copy, and what it holds is corral's own code: nothing a sandbox or
a message sends reaches it. A root the provider cannot write falls back to the package as
installed (slower to start, same behaviour).
"""

from __future__ import annotations

import compileall
import hashlib
import logging
import py_compile
import shutil
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

COPIES_DIR = ".runner"  # under the sandbox root: a dot name, never a sandbox's
STAGING_PREFIX = ".making-"
# A staging directory older than this was left by a maker that died (a copy takes well
# under a second): removed by the next process that makes a copy there.
STALE_STAGING_S = 600.0


def package_digest(package: Path) -> str:
    """A digest of the package's files (names and contents) and of this interpreter's
    version (the bytecode's format)."""
    digest = hashlib.sha256(sys.version.encode())
    for path in sorted(_sources(package)):
        digest.update(str(path.relative_to(package)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def compiled_copy(package: Path, root: Path) -> Path:
    """The compiled copy of ``package`` under ``root`` (made now if it is not there yet);
    ``package`` itself where the copy cannot be made."""
    try:
        target = root / COPIES_DIR / package_digest(package) / package.name
        if target.is_dir():
            return target
        return _make(package, target)
    except OSError as exc:
        logger.warning(
            "the runner package could not be compiled under the sandbox root; sandboxes "
            "import it as installed (their runners start slower)",
            extra={"error": str(exc)},
        )
        return package


def _sources(package: Path) -> list[Path]:
    return [
        path
        for path in package.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    ]


def _make(package: Path, target: Path) -> Path:
    """Copy and compile in a directory of our own, then rename it into place: a sandbox
    never binds a half-made copy, and of two processes making it at once one wins."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(target.parent)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=target.parent))
    try:
        made = staging / package.name
        for source in _sources(package):
            destination = made / source.relative_to(package)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, destination)
        compiled = compileall.compile_dir(
            made,
            quiet=2,
            invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
        )
        if not compiled:
            raise OSError(f"compiling the runner package under {made} failed")
        for path in (made, *made.rglob("*")):  # whoever a sandbox runs as reads it
            path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            made.rename(target)
        except OSError:
            if not target.is_dir():  # not another process's win: a real failure
                raise
        return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_stale_staging(directory: Path) -> None:
    """Remove what makers killed mid-copy left in ``directory`` (their staging, once it is
    :data:`STALE_STAGING_S` old); a maker at work now keeps its own."""
    cutoff = time.time() - STALE_STAGING_S
    for staging in directory.glob(f"{STAGING_PREFIX}*"):
        try:
            stale = staging.lstat().st_mtime < cutoff
        except OSError:
            continue  # gone meanwhile
        if stale:
            shutil.rmtree(staging, ignore_errors=True)
