"""The key of a caller on a Unix socket (scheduler/peers.py), told for real processes: callers
in bubblewrap pid namespaces of their own, as local sandboxes run, and this test's own."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from corral.scheduler.peers import MAX_ANCESTRY, peer_key
from tests.unix_callers import caller_argv, nested, orphaned, sandboxed, script


@pytest.fixture
def listener() -> Iterator[tuple[socket.socket, Path]]:
    """A listening Unix socket in a short directory of its own (paths are short there)."""
    with tempfile.TemporaryDirectory(prefix="corral-peers-") as directory:
        path = Path(directory) / "peer.sock"
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(path))
            server.listen(16)
            server.settimeout(60)
            yield server, path


def keys_of(server: socket.socket, command: Sequence[str], connections: int) -> list[str | None]:
    """Run ``command``; the key of each of the ``connections`` it makes (each is closed once
    its key is known, which lets its caller go on)."""
    with subprocess.Popen(command, stdout=subprocess.DEVNULL) as process:
        keys = []
        for _ in range(connections):
            connection, _ = server.accept()
            with connection:
                keys.append(peer_key(connection))
        assert process.wait(timeout=60) == 0
    return keys


def test_every_process_of_a_sandbox_has_its_key_and_another_sandbox_another(
    listener: tuple[socket.socket, Path], require_bwrap: str
) -> None:
    server, path = listener
    # The ways a sandbox could try to pass for several: a new session, a process handed to
    # the namespace's first, a chain of processes, a nested user and pid namespace.
    tries = script(
        caller_argv(path, "plain", 1, "held"),
        caller_argv(path, "setsid", 1, "setsid,held"),
        orphaned(caller_argv(path, "orphan", 1, "orphan,held")),
        caller_argv(path, "chain", 1, "chain:20,held"),
        nested(caller_argv(path, "nested", 1, "held")),
    )
    keys = keys_of(server, sandboxed(require_bwrap, tries), 5)
    assert len(set(keys)) == 1 and keys[0] is not None and keys[0].startswith("pidns:")
    other = keys_of(server, sandboxed(require_bwrap, caller_argv(path, "other", 1, "held")), 1)
    assert other[0] is not None and other[0] != keys[0]


def test_a_host_process_is_keyed_by_its_uid() -> None:
    here, there = socket.socketpair(socket.AF_UNIX)
    with here, there:
        assert peer_key(here) == f"uid:{os.getuid()}"


def test_a_chain_of_processes_past_the_walks_cap_is_not_told_apart(
    listener: tuple[socket.socket, Path], require_bwrap: str
) -> None:
    server, path = listener
    deep = caller_argv(path, "deep", 1, f"chain:{MAX_ANCESTRY + 5},held")
    assert keys_of(server, sandboxed(require_bwrap, deep), 1) == [None]
