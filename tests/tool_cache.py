"""A tool cache for kits, made offline from this host's own tools (docs/dispatch.md#kits).

``node_bundle(root)`` puts this host's ``node`` under ``root/node/<major>/``: the binary in
``libexec/``, every shared library it loads (the dynamic loader included) in ``lib/``, and a
``bin/node`` that starts it through that loader, so that it runs in a sandbox image whatever
libraries the image has. That is what a deployment's tool cache holds, for the tests.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

_LIBRARY = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x")


def node_major(node: str) -> str:
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=True)
    return version.stdout.strip().lstrip("v").split(".")[0]


def node_bundle(root: Path, node: str) -> Path:
    """The cache's ``node/<major>/bin`` directory, made from ``node``."""
    real = Path(node).resolve()
    home = root / "node" / node_major(node)
    for folder in ("bin", "lib", "libexec"):
        (home / folder).mkdir(parents=True, exist_ok=True)
    shutil.copy2(real, home / "libexec" / "node")
    listed = subprocess.run(["ldd", str(real)], capture_output=True, text=True, check=True)
    loader = None
    for path in _LIBRARY.findall(listed.stdout):
        target = home / "lib" / Path(path).name
        shutil.copy2(Path(path).resolve(), target)
        if Path(path).name.startswith("ld-linux"):
            loader = target.name
    assert loader is not None, f"no dynamic loader in ldd's answer: {listed.stdout}"
    launcher = home / "bin" / "node"
    launcher.write_text(
        "#!/bin/sh\n"
        'here=$(dirname "$0")/..\n'
        f'exec "$here/lib/{loader}" --library-path "$here/lib" "$here/libexec/node" "$@"\n'
    )
    for path in (launcher, *home.rglob("*")):
        path.chmod(0o755)
    root.chmod(0o755)
    for parent in home.parents:
        if parent == root.parent:
            break
        parent.chmod(0o755)
    return home / "bin"
