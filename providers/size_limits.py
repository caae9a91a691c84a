"""What a provider keeps of a command's output and of a file it copies out of a sandbox: no
more than its caller's limit, counted while the bytes arrive (docs/sessions.md).

Output past the limit is read and dropped, so the command runs on as it would have; a copy
stops one byte past the limit, so a file larger than it is known to be, whatever its size
said. Either way, what this process holds is bounded by the limit, not by the sandbox.
"""

from __future__ import annotations

import codecs
import functools
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from corral.providers.base import ExecResult
from corral.providers.errors import FileTooLargeError

CHUNK_BYTES = 64 * 1024  # one read of a pipe, a socket or a file


class OutputBuffer:
    """The first ``limit`` bytes of one output stream; the rest is noticed, not kept."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.truncated = False
        self._kept = bytearray()

    def add(self, chunk: bytes | str) -> None:
        """Keep what still fits of ``chunk`` (text is counted as UTF-8)."""
        if not chunk:
            return
        room = self.limit - len(self._kept)
        if room <= 0:
            self.truncated = True
            return
        if isinstance(chunk, str):
            # A character is at least one byte: `room` characters are at least `room` bytes,
            # so a long text is never encoded whole to keep its head.
            data = chunk[:room].encode(errors="replace")
            self.truncated |= len(chunk) > room
        else:
            data = chunk
        self.truncated |= len(data) > room
        self._kept += data[:room]

    def text(self) -> tuple[str, bool]:
        """What was kept, decoded (invalid bytes replaced), and whether it is cut: at most
        ``limit`` bytes of UTF-8, never a character cut in two."""
        if not self.truncated:
            text = self._kept.decode(errors="replace")
        else:  # not final: a character the cut split is held back, not replaced
            text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(self._kept)
        encoded = text.encode()
        if len(encoded) <= self.limit:
            return text, self.truncated
        # Replacement characters are longer than the bytes they replace.
        return encoded[: self.limit].decode(errors="ignore"), True


class ExecOutput:
    """A command's stdout and stderr, each bounded at ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.stdout = OutputBuffer(limit)
        self.stderr = OutputBuffer(limit)

    def result(self, *, exit_code: int, duration_s: float) -> ExecResult:
        stdout, stdout_cut = self.stdout.text()
        stderr, stderr_cut = self.stderr.text()
        return ExecResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=exit_code,
            duration_s=duration_s,
            truncated=stdout_cut or stderr_cut,
        )


def reads(read: Callable[[int], bytes]) -> Iterator[bytes]:
    """``read(CHUNK_BYTES)`` over and over, until it gives nothing."""
    return iter(functools.partial(read, CHUNK_BYTES), b"")


def copy_at_most(chunks: Iterable[bytes], target: Path, max_bytes: int, source: str) -> int:
    """Write ``chunks`` to ``target`` (made, or emptied) and answer how many bytes they were;
    stop at ``max_bytes + 1`` bytes, all ``target`` then holds.

    Raises:
        FileTooLargeError: the chunks held more than ``max_bytes``.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with target.open("wb") as writer:
        for chunk in chunks:
            room = max_bytes + 1 - written
            writer.write(chunk[:room])
            written += min(len(chunk), room)
            if written > max_bytes:
                raise FileTooLargeError(source, max_bytes)
    return written


def refuse_larger(source: str, size: int | None, max_bytes: int) -> None:
    """Refuse a file whose size (as the sandbox tells it, if it does) is over the limit,
    before any of it is copied.

    Raises:
        FileTooLargeError: ``size`` is more than ``max_bytes``.
    """
    if size is not None and size > max_bytes:
        raise FileTooLargeError(source, max_bytes)


# A sandbox's own log, read for its last lines (SupportsEndLog): what one read takes in at
# most, however long the lines the log is asked for are.
END_LOG_READ_LIMIT = 4 * 1024 * 1024


def log_tail(
    chunks: Iterable[bytes], *, max_lines: int, max_bytes: int, read_limit: int = END_LOG_READ_LIMIT
) -> str:
    """The last ``max_lines`` lines of ``chunks``, and of them the last ``max_bytes`` bytes,
    as text (invalid bytes replaced). No more than ``max_bytes`` plus a chunk is held at a
    time, and reading stops after ``read_limit`` bytes: a log longer than that is answered
    with the end of what was read."""
    kept = bytearray()
    read = 0
    for chunk in chunks:
        kept += chunk
        if len(kept) > max_bytes:
            del kept[: len(kept) - max_bytes]
        read += len(chunk)
        if read >= read_limit:
            break
    return last_lines(bytes(kept), max_lines).decode(errors="replace")


def last_lines(data: bytes, max_lines: int) -> bytes:
    """The last ``max_lines`` lines of ``data`` (a last line without its newline counts)."""
    lines = data.splitlines(keepends=True)
    return b"".join(lines[-max_lines:]) if max_lines > 0 else b""


def file_tail(path: Path, *, max_lines: int, max_bytes: int) -> str | None:
    """The last lines of the regular file ``path`` as :func:`log_tail` answers them, read
    from its last ``max_bytes`` bytes alone; None when there is no such file. A symbolic link
    is not followed, and anything but a regular file of one link (a FIFO, a device, a hard
    link to another file) reads as empty."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError:  # a link (ELOOP), or not readable: nothing of the sandbox's to show
        return ""
    with os.fdopen(fd, "rb") as handle:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode) or found.st_nlink != 1:
            return ""
        handle.seek(max(0, found.st_size - max_bytes))
        return log_tail([handle.read(max_bytes)], max_lines=max_lines, max_bytes=max_bytes)
