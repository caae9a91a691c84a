"""A RabbitMQ vhost of the run's own on the machine's RabbitMQ (``CORRAL_TEST_AMQP_URL``,
default ``amqp://guest:guest@127.0.0.1:5672//``), made and removed with ``rabbitmqctl``:
a vhost is RabbitMQ's way of keeping deployments apart (there is no key prefix)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

import pytest

AMQP_URL = os.environ.get("CORRAL_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


def _require() -> str:
    address = urlsplit(AMQP_URL)
    try:
        with socket.create_connection((address.hostname, address.port or 5672), timeout=2):
            pass
    except OSError:
        problem = f"RabbitMQ is not reachable at {address.hostname}:{address.port or 5672}"
    else:
        ctl = shutil.which("rabbitmqctl")
        if ctl is not None:
            return ctl
        problem = "rabbitmqctl is not on PATH (it makes the run's vhost)"
    if os.environ.get("CI"):
        pytest.fail(problem)
    pytest.skip(problem)


@contextmanager
def private_vhost() -> Iterator[str]:
    """The broker URL of a new vhost on which the guest user may do everything."""
    ctl = _require()
    vhost = f"corral-test-{uuid.uuid4().hex[:10]}"
    user = urlsplit(AMQP_URL).username or "guest"
    subprocess.run([ctl, "-q", "add_vhost", vhost], check=True, capture_output=True)
    try:
        subprocess.run(
            [ctl, "-q", "set_permissions", "-p", vhost, user, ".*", ".*", ".*"],
            check=True,
            capture_output=True,
        )
        yield urlunsplit(urlsplit(AMQP_URL)._replace(path=f"/{vhost}"))
    finally:
        subprocess.run([ctl, "-q", "delete_vhost", vhost], check=False, capture_output=True)
