"""A local sandbox's output, copied into its log within a bound. Standard library only: the
supervisor (:mod:`corral.providers.local.supervisor`) imports it from beside itself.

The sandbox never holds its log file: its stdout and stderr are one pipe, and the supervisor
copies what comes through it into ``output.log`` up to ``max_bytes``. Past that it says so
in the log, keeps reading (the work is neither blocked nor broken: its writes succeed) and
keeps only the last ``tail_bytes``, which go at the end of the log when the sandbox ends, so
that its end log still tells how the work ended. The log so holds at most ``max_bytes +
tail_bytes`` and two notices, whatever the sandbox writes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

# The pipe's buffer: large reads, so that copying a flood costs the supervisor less than
# writing it costs the sandbox. Best effort (a user over its pipe quota gets the default).
PIPE_BYTES = 1024 * 1024
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
# Reads of one pump at most, so that a flood never keeps the supervisor from its deadline.
READS_PER_PUMP = 16
# Reads once the sandbox has ended, at most: what its pipe still holds.
FINAL_READS = 64
_MIB = 1024 * 1024


def output_pipe() -> tuple[int, int]:
    """A pipe for the sandbox's stdout and stderr: its read end (non-blocking, the
    supervisor's) and its write end (the sandbox's)."""
    read_end, write_end = os.pipe()
    with contextlib.suppress(OSError):
        fcntl.fcntl(write_end, _F_SETPIPE_SZ, PIPE_BYTES)
    os.set_blocking(read_end, False)
    return read_end, write_end


def _size(count: int) -> str:
    return f"{count // _MIB} MiB" if count % _MIB == 0 else f"{count} bytes"


class BoundedCopy:
    """What comes through ``source`` (a non-blocking read end), appended to ``log`` (a file
    descriptor) up to ``max_bytes``; of the rest only the last ``tail_bytes``, at the end."""

    def __init__(self, source: int, log: int, max_bytes: int, tail_bytes: int) -> None:
        self.source, self.log = source, log
        self.max_bytes, self.tail_bytes = max_bytes, tail_bytes
        self.written = self.dropped = 0
        self.tail = bytearray()
        self.open = True
        self.ends_line = True  # whether what was written last ended a line

    def pump(self, reads: int = READS_PER_PUMP) -> None:
        """Copy what is waiting in the pipe (at most ``reads`` reads); at its end of file
        (no writer left) the pipe is closed and ``open`` turns False."""
        for _ in range(reads):
            try:
                chunk = os.read(self.source, PIPE_BYTES)
            except BlockingIOError:
                return
            if not chunk:
                os.close(self.source)
                self.open = False
                return
            self._take(chunk)

    def finish(self) -> None:
        """Copy the rest (the sandbox has ended: nothing writes any more, or a writer that
        escaped its end is cut off), then the kept end of what was dropped."""
        if self.open:
            self.pump(FINAL_READS)
            if self.open:
                os.close(self.source)
                self.open = False
        if self.dropped:
            self._notice(
                f"[corral: {self.dropped} bytes of output were dropped; "
                f"the last {len(self.tail)} of them follow]"
            )
            self._write(bytes(self.tail))

    def _take(self, chunk: bytes) -> None:
        room = self.max_bytes - self.written
        if room > 0:
            self._write(chunk[:room])
            self.written += min(room, len(chunk))
            chunk = chunk[room:]
            if not chunk:
                return
        if not self.dropped:
            self._notice(
                f"[corral: the sandbox's output is capped at {_size(self.max_bytes)}: what "
                "follows is dropped, but for its end, written here when the sandbox ends]"
            )
        self.dropped += len(chunk)
        self.tail += chunk[-self.tail_bytes :]
        del self.tail[: -self.tail_bytes]

    def _notice(self, text: str) -> None:
        """A line of corral's in the log, on a line of its own."""
        self._write(("" if self.ends_line else "\n").encode() + text.encode() + b"\n")

    def _write(self, data: bytes) -> None:
        if data:
            self.ends_line = data.endswith(b"\n")
        while data:
            data = data[os.write(self.log, data) :]
