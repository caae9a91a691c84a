"""Hand-made result bundles for tests: archives with whatever members a test wants, the
format's rules kept or broken on purpose."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from typing import Any

Member = tarfile.TarInfo | tuple[str, bytes]


def archive(members: list[Member]) -> io.BytesIO:
    """A gzipped tar of ``members`` (name and bytes, or a TarInfo of a link or device)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tar.addfile(member)
                continue
            name, data = member
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out.seek(0)
    return out


def manifest(*entries: dict[str, Any]) -> tuple[str, bytes]:
    body = {"version": 1, "base": {"kind": "workspace"}, "entries": entries, "refused": []}
    return ("manifest.json", json.dumps(body).encode())


def file_entry(path: str, data: bytes, **overrides: Any) -> dict[str, Any]:
    """The manifest entry of a file ``path`` added with ``data``."""
    return {
        "path": path,
        "operation": "add",
        "type": "file",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "mode": 0o644,
        "target": None,
        "patch": None,
        "file": f"files/{path}",
        **overrides,
    }


def deleted_entry(path: str) -> dict[str, Any]:
    fields = ("type", "size", "sha256", "mode", "target", "patch", "file")
    return {"path": path, "operation": "delete", **dict.fromkeys(fields)}
