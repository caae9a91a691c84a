"""Hostile and malformed broker messages, built by hand as a buggy or hostile sender would.

Celery-shaped ones are kombu Redis envelopes around a Celery protocol 2 message whose parts
are wrong; raw ones are bytes pushed onto the list as they are.
"""

from __future__ import annotations

import base64
import json
import os
import uuid
import zlib
from typing import Any

SECRET = f"hostile-env-{uuid.uuid4().hex}"


def envelope(
    body: Any,
    *,
    task: str | None = "corral.dispatch",
    task_id: str | None = None,
    headers: Any = None,
    raw_body: bytes | None = None,
    routing_key: str = "dispatch",
) -> bytes:
    """A kombu Redis list entry around a Celery protocol 2 message."""
    data = raw_body if raw_body is not None else json.dumps(body).encode()
    if headers is None:
        headers = {
            "lang": "py",
            "task": task,
            "id": task_id or str(uuid.uuid4()),
            "argsrepr": "()",
            "kwargsrepr": "{}",
        }
    entry = {
        "body": base64.b64encode(data).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": {
            "correlation_id": str(uuid.uuid4()),
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": routing_key},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    return json.dumps(entry).encode()


def dispatch_message(org: str, command: str, **fields: Any) -> dict[str, Any]:
    return {
        "org": org,
        "project": "web",
        "profile": "default",
        "work": {"kind": "shell", "command": command},
        **fields,
    }


def with_secret(org: str) -> dict[str, Any]:
    return dispatch_message(org, "echo hostile", env={"API_TOKEN": SECRET, "PLAIN": SECRET})


def celery_shapes(org: str) -> dict[str, tuple[str, bytes]]:
    """name → (task id, entry): Celery messages whose call is wrong; each must become an
    ``invalid_message`` item keyed by its task id."""
    message = with_secret(org)
    shapes = {
        "body is a dict": message,
        "body is a one-element list": [[message]],
        "args is an int": [5, {}, {}],
        "args is null": [None, {}, {}],
    }
    out = {}
    for name, body in shapes.items():
        task_id = str(uuid.uuid4())
        out[name] = (task_id, envelope(body, task_id=task_id))
    return out


def raw_shapes() -> dict[str, tuple[str, bytes]]:
    """name → (dead-letter reason, bytes): nothing about them can be read as a task."""
    bad_base64 = json.loads(envelope([[{"env": {"K": SECRET}}], {}, {}]))
    bad_base64["body"] = "!!not base64 " + SECRET
    not_a_dict = json.loads(envelope([[{}], {}, {}]))
    not_a_dict["headers"] = ["task", SECRET]
    return {
        "random bytes": ("not_json", os.urandom(256)),
        "not JSON": ("not_json", f"hello {SECRET}".encode()),
        "empty": ("not_json", b""),
        "a JSON number": ("not_an_envelope", b"42"),
        "a JSON list": ("not_an_envelope", json.dumps([SECRET, 1]).encode()),
        "bad base64 envelope": ("bad_body_encoding", json.dumps(bad_base64).encode()),
        "headers not a dict": ("bad_headers", json.dumps(not_a_dict).encode()),
        "10 MB of garbage": ("too_large", os.urandom(10 * 1024 * 1024)),
    }


def garbage_timelimit(org: str, key: str) -> bytes:
    """A valid dispatch whose ``timelimit`` header is garbage (the intake does not use it)."""
    task_id = str(uuid.uuid4())
    headers = {
        "lang": "py",
        "task": "corral.dispatch",
        "id": task_id,
        "timelimit": "soon",
        "argsrepr": "()",
        "kwargsrepr": "{}",
    }
    body = [[dispatch_message(org, "echo timelimit", idempotency_key=key)], {}, {}]
    return envelope(body, headers=headers)


def compression_bomb(org: str, inflated_mib: int = 256) -> tuple[str, bytes]:
    """A zlib body of ``inflated_mib`` MiB of spaces after a valid prefix: about 256 KiB sent."""
    compressor = zlib.compressobj(9)
    prefix = json.dumps([[dispatch_message(org, "echo bomb")], {}, {}])[:-1].encode()
    parts = [compressor.compress(prefix)]
    chunk = b" " * (1024 * 1024)
    for _ in range(inflated_mib):
        parts.append(compressor.compress(chunk))
    parts.append(compressor.compress(b"]"))
    parts.append(compressor.flush())
    task_id = str(uuid.uuid4())
    headers = {
        "lang": "py",
        "task": "corral.dispatch",
        "id": task_id,
        "compression": "application/x-gzip",
    }
    return task_id, envelope(None, headers=headers, raw_body=b"".join(parts))


def deep_message(org: str, depth: int = 900) -> tuple[str, bytes]:
    """A dispatch whose code arguments nest ``depth`` lists deep."""
    nested: Any = "bottom"
    for _ in range(depth):
        nested = [nested]
    message = dispatch_message(org, "x", env={"K": SECRET})
    message["work"] = {
        "kind": "code",
        "code": "def main(**a):\n    return 1\n",
        "arguments": {"deep": nested},
    }
    task_id = str(uuid.uuid4())
    return task_id, envelope([[message], {}, {}], task_id=task_id)
