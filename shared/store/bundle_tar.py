"""The tar layer of a result bundle: plain POSIX ustar file members, read as a stream.

Each 512-byte header is checked (its checksum, the ``ustar\\0`` magic with version ``00``,
a regular file's type, an octal size, a UTF-8 name) before anything reads what it declares.
A pax or GNU extended header, a link, a device, a directory or a base-256 size is refused at
its header: no declared size is ever read into memory, as the standard library's ``tarfile``
does with a pax header's payload before its caller sees the member. The reader takes no byte
the structure does not account for: headers, the payloads its caller reads, their padding,
and at most :data:`END_PADDING_MAX` zero bytes after the end-of-archive block, after which the
stream must end. Messages name a member by its number, never by its name.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from corral.shared.errors import CorralError

BLOCK = 512
# After the end-of-archive block a writer pads to its record size: tarfile and GNU tar's
# default is 10 KiB, 64 KiB leaves room for a larger blocking factor.
END_PADDING_MAX = 64 * 1024
USTAR_MAGIC = b"ustar\x0000"  # magic "ustar\0" and version "00" (POSIX.1-1988)
REGULAR_TYPES = (b"0", b"\x00")
_CHUNK = 64 * 1024
_OCTAL_DIGITS = frozenset(b"01234567")
_KINDS = {
    b"1": "a hard link",
    b"2": "a symlink",
    b"3": "a device",
    b"4": "a device",
    b"5": "a directory",
    b"6": "a FIFO",
    b"7": "a contiguous file",
    b"x": "a pax extended header",
    b"g": "a pax global header",
    b"L": "a GNU long name",
    b"K": "a GNU long link name",
    b"S": "a GNU sparse file",
}


class Readable(Protocol):
    """A stream of bytes: an inflating gzip reader, a file."""

    def read(self, size: int, /) -> bytes:
        """Up to ``size`` bytes; b"" at the end."""
        ...


class TarFormatError(CorralError, ValueError):
    """The bundle's archive is not made of plain ustar file members."""

    code = "bundle_invalid"


@dataclass(frozen=True)
class TarMember:
    """One member's checked header: its number (from 1), name and payload size."""

    number: int
    name: str
    size: int


class TarReader:
    """The members of an uncompressed tar stream, each header checked before its payload.

    Iterating yields each member's header; :meth:`read` reads its payload, and moving to the
    next member skips what is left of it (the caller decides from the header whether to).
    """

    def __init__(self, stream: Readable) -> None:
        self._stream = stream
        self._left = 0  # the current member's payload bytes not read yet
        self._padding = 0  # and the zeros after it, up to the next block

    def __iter__(self) -> Iterator[TarMember]:
        """Each member's header, checked; the archive's end is checked after the last one.

        Raises:
            TarFormatError: a header, the end of the archive or the stream is not allowed.
        """
        number = 0
        while True:
            self._skip_rest()
            number += 1
            block = self._take(BLOCK)
            if len(block) < BLOCK:
                raise TarFormatError(
                    f"the bundle's archive ends inside member {number}'s header"
                    if block
                    else "the bundle's archive ends without its end-of-archive block"
                )
            if block == bytes(BLOCK):
                self._check_end()
                return
            member = parse_header(block, number)
            self._left, self._padding = member.size, -member.size % BLOCK
            yield member

    def read(self, size: int) -> bytes:
        """Up to ``size`` bytes of the current member's payload; b"" at its end.

        Raises:
            TarFormatError: the stream ends inside the payload, or is not readable.
        """
        data = self._take(min(size, self._left))
        if len(data) < min(size, self._left):
            raise TarFormatError("the bundle's archive ends inside a member")
        self._left -= len(data)
        return data

    def _skip_rest(self) -> None:
        while self._left:
            self.read(_CHUNK)
        if len(self._take(self._padding)) < self._padding:
            raise TarFormatError("the bundle's archive ends inside a member")
        self._padding = 0

    def _check_end(self) -> None:
        """What follows the first end-of-archive block: zeros, up to END_PADDING_MAX."""
        seen = 0
        while chunk := self._take(min(_CHUNK, END_PADDING_MAX + 1 - seen)):
            if chunk.count(0) != len(chunk):
                raise TarFormatError("the bundle has data after the end of its archive")
            seen += len(chunk)
            if seen > END_PADDING_MAX:
                raise TarFormatError(
                    "the bundle has more padding after the end of its archive than tar writes"
                )

    def _take(self, size: int) -> bytes:
        """``size`` bytes of the stream, fewer only at its end."""
        parts, wanted = [], size
        try:
            while wanted > 0 and (chunk := self._stream.read(wanted)):
                parts.append(chunk)
                wanted -= len(chunk)
        except (OSError, EOFError, zlib.error) as exc:  # gzip's: bad header, data or CRC, cut
            raise TarFormatError("the bundle is not a readable gzipped tar") from exc
        return b"".join(parts)


def parse_header(block: bytes, number: int) -> TarMember:
    """Member ``number``'s 512-byte header, when it is a plain ustar regular file's.

    Raises:
        TarFormatError: a wrong checksum, not ustar, not a regular file, a size that is not
            octal, a name that is not UTF-8.
    """
    where = f"member {number}"
    stored = _octal(block[148:156])
    if stored is None or stored != sum(block[:148]) + sum(block[156:]) + 8 * ord(" "):
        raise TarFormatError(f"{where}'s header checksum is wrong")
    if block[257:265] != USTAR_MAGIC:
        raise TarFormatError(f"{where} is not a POSIX ustar header")
    typeflag = block[156:157]
    if typeflag not in REGULAR_TYPES:
        kind = _KINDS.get(typeflag, "an unknown type")
        raise TarFormatError(
            f"{where} is not a regular file but {kind} (links, devices, directories and "
            "extended headers are refused)"
        )
    size = _octal(block[124:136])
    if size is None:
        raise TarFormatError(f"{where}'s size is not an octal number (base-256 sizes are refused)")
    name, prefix = block[0:100].split(b"\x00")[0], block[345:500].split(b"\x00")[0]
    try:
        text = (prefix + b"/" + name if prefix else name).decode("utf-8")
    except UnicodeDecodeError:
        raise TarFormatError(f"{where}'s name is not UTF-8") from None
    return TarMember(number, text, size)


def _octal(field: bytes) -> int | None:
    """A numeric field's value: octal digits, space- or NUL-terminated; None otherwise."""
    digits = field.rstrip(b" \x00").lstrip(b" ")
    if not digits or not set(digits) <= _OCTAL_DIGITS:
        return None
    return int(digits, 8)
