"""One of the api's child processes (``CORRAL_API_PROCESSES`` > 1), started by the parent
``corral api`` as ``python -m corral.cli.api_child <parent pid> <index> <fd>...`` with the
listening sockets it inherited (``scheduler/api/processes.py``). It ends when its parent
does, however the parent ended (a SIGKILL too): it would otherwise keep the api's port."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys

from corral.cli.failures import EXIT_UNREACHABLE, explain
from corral.cli.processes import configure_logging, prepare
from corral.scheduler.api.processes import READY, READY_FD_VARIABLE
from corral.shared.errors import CorralError

log = logging.getLogger("corral.api")
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_parent(parent: int) -> None:
    """SIGTERM this process when its parent ends; exit now if it already has."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # it ended before the line above
        raise SystemExit(0)


def serve_child(parent: int, index: int, fds: list[int]) -> None:
    """The process's runtime, then the inherited listeners until SIGTERM.

    Raises:
        SystemExit: non-zero, with one line naming what to fix, when the runtime cannot be
            made (the parent counts it among the children that died at their start).
    """
    from corral.scheduler.api.server import make_server, run_server

    end_with_parent(parent)
    configure_logging()
    try:
        prepare()
    except CorralError as exc:
        log.critical("api process %d cannot start: %s", index, exc.message)
        raise SystemExit(2) from None
    except Exception as exc:
        said = explain(exc)
        if said is None:
            raise
        log.critical("api process %d cannot start: %s", index, said)
        raise SystemExit(EXIT_UNREACHABLE) from None
    say_ready()
    sockets = [socket.socket(fileno=fd) for fd in fds]
    run_server(make_server(), sockets)


def say_ready() -> None:
    """Tell the parent this process could make its runtime: it dies no longer as one that
    cannot start, however long that took (scheduler/api/processes.py)."""
    fd = os.environ.pop(READY_FD_VARIABLE, None)
    if fd is None:
        return
    with contextlib.suppress(OSError):  # a parent gone: this process ends with it
        os.write(int(fd), READY)
    with contextlib.suppress(OSError):
        os.close(int(fd))


if __name__ == "__main__":
    serve_child(int(sys.argv[1]), int(sys.argv[2]), [int(fd) for fd in sys.argv[3:]])
