"""The Daytona daemon's marked log split into stdout and stderr
(corral.providers.daytona.logs.Demux), whatever the messages' boundaries."""

from __future__ import annotations

import pytest

from corral.providers.daytona.logs import Demux
from corral.providers.size_limits import ExecOutput

OUT, ERR = b"\x01\x01\x01", b"\x02\x02\x02"
LOG = b"ignored" + OUT + b"hello " + ERR + b"oops\n" + OUT + b"world\x01\n" + ERR + b"\x02"


def _split(data: bytes, size: int) -> list[bytes]:
    return [data[start : start + size] for start in range(0, len(data), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 7, len(LOG)])
def test_markers_split_across_messages_still_route_the_output(size: int) -> None:
    output = ExecOutput(1024)
    demux = Demux(output)
    for message in _split(LOG, size):
        demux.feed(message)
    demux.finish()
    assert output.stdout.text() == ("hello world\x01\n", False)
    assert output.stderr.text() == ("oops\n\x02", False)


def test_each_stream_keeps_to_the_limit() -> None:
    output = ExecOutput(4)
    demux = Demux(output)
    demux.feed(OUT + b"x" * 100 + ERR + b"e" * 3)
    demux.finish()
    assert (output.stdout.text(), output.stderr.text()) == (("xxxx", True), ("eee", False))
