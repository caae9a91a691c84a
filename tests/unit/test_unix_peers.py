"""The key of a caller on a Unix socket (scheduler/api/peers.py), told for real processes: callers
in bubblewrap pid namespaces of their own, as local sandboxes run, and this test's own."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from corral.scheduler.api.peers import MAX_ANCESTRY, peer_key
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


def test_a_sandbox_whose_namespace_number_was_reused_gets_a_key_of_its_own(
    listener: tuple[socket.socket, Path], require_bwrap: str
) -> None:
    # The kernel hands an ended namespace's inode number to a new one (seen within a handful
    # of sandboxes): the new sandbox must not inherit the old one's bucket.
    server, path = listener
    keys: list[str] = []
    seen_inodes: set[str] = set()
    reused = False
    for number in range(200):
        caller = caller_argv(path, f"s{number}", 1, "held")
        [key] = keys_of(server, sandboxed(require_bwrap, caller), 1)
        assert key is not None and key.startswith("pidns:")
        inode = key.split(":")[1]
        reused = inode in seen_inodes
        seen_inodes.add(inode)
        keys.append(key)
        if reused:
            break
    assert reused, "no namespace number came back within 200 sandboxes"
    assert len(set(keys)) == len(keys), keys
