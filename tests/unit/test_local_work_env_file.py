"""The memory file that carries the work's variables to a local sandbox is closed on exec:
only the command it is passed to (pass_fds) inherits it, never another child the api or a
supervisor starts meanwhile (the api is multi-threaded)."""

from __future__ import annotations

import fcntl
import os

from corral.providers.local import provider as local
from corral.providers.local import supervisor as local_supervisor

VALUES = {"SECRET": "the tenant's"}


def _closed_on_exec(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC)


def test_the_providers_work_env_file_is_closed_on_exec() -> None:
    env: dict[str, str] = {}
    with local._work_env_file(VALUES, env) as fds:
        assert [env[local.WORK_ENV_FD_VARIABLE]] == [str(fd) for fd in fds]
        assert all(_closed_on_exec(fd) for fd in fds)


def test_the_supervisors_work_env_file_is_closed_on_exec() -> None:
    env: dict[str, str] = {}
    fd = local_supervisor._work_env_file({"variable": "FD", "values": VALUES}, env)
    assert fd is not None
    try:
        assert env["FD"] == str(fd)
        assert _closed_on_exec(fd)
    finally:
        os.close(fd)
