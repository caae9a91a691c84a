"""Hand-made result bundles for tests: archives with whatever members a test wants, the
format's rules kept or broken on purpose, down to single tar headers."""

from __future__ import annotations

import hashlib
import io
import json
import struct
import tarfile
import zlib
from typing import Any

BLOCK = 512
USTAR = b"ustar\x0000"

Member = tarfile.TarInfo | tuple[str, bytes]


def archive(members: list[Member]) -> io.BytesIO:
    """A gzipped tar of ``members`` (name and bytes, or a TarInfo of a link or device)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz", format=tarfile.USTAR_FORMAT) as tar:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tar.addfile(member)
                continue
            name, data = member
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out.seek(0)
    return out


def manifest(*entries: dict[str, Any]) -> tuple[str, bytes]:
    body = {"version": 1, "base": {"kind": "workspace"}, "entries": entries, "refused": []}
    return ("manifest.json", json.dumps(body).encode())


def file_entry(path: str, data: bytes, **overrides: Any) -> dict[str, Any]:
    """The manifest entry of a file ``path`` added with ``data``."""
    return {
        "path": path,
        "operation": "add",
        "type": "file",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "mode": 0o644,
        "target": None,
        "patch": None,
        "file": f"files/{path}",
        **overrides,
    }


def deleted_entry(path: str) -> dict[str, Any]:
    fields = ("type", "size", "sha256", "mode", "target", "patch", "file")
    return {"path": path, "operation": "delete", **dict.fromkeys(fields)}


def header(
    name: str | bytes,
    size: int,
    *,
    typeflag: bytes = b"0",
    magic: bytes = USTAR,
    size_field: bytes | None = None,
    checksum_error: int = 0,
) -> bytes:
    """One hand-made 512-byte tar header; its checksum off by ``checksum_error``."""
    block = bytearray(BLOCK)
    encoded = name.encode() if isinstance(name, str) else name
    block[0 : len(encoded)] = encoded
    block[100:108] = b"0000644\x00"
    block[108:116] = block[116:124] = b"0000000\x00"
    block[124:136] = size_field if size_field is not None else b"%011o\x00" % size
    block[136:148] = b"00000000000\x00"
    block[148:156] = b" " * 8
    block[156:157] = typeflag
    block[257:265] = magic
    block[148:156] = b"%06o\x00 " % (sum(block) + checksum_error)
    return bytes(block)


def padded(data: bytes) -> bytes:
    """``data`` and the zeros that end it on a block boundary."""
    return data + bytes(-len(data) % BLOCK)


def member_blocks(name: str, data: bytes, **fields: Any) -> bytes:
    """A hand-made regular file member: its header and padded data."""
    return header(name, len(data), **fields) + padded(data)


def manifest_blocks(*entries: dict[str, Any]) -> bytes:
    """A hand-made ``manifest.json`` member naming ``entries``."""
    name, data = manifest(*entries)
    return member_blocks(name, data)


def gzip_stream(head: bytes, zeros: int = 0, tail: bytes = b"") -> bytes:
    """``head``, ``zeros`` zero bytes (a multiple of 1 MiB) and ``tail``, gzipped, in a
    fraction of the time compressing the zeros would take: after a full flush the deflate
    stream refers to nothing before, so the compressed MiB of zeros can be repeated."""
    mib = 1 << 20
    assert zeros % mib == 0
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    parts = [deflate.compress(head) + deflate.flush(zlib.Z_FULL_FLUSH)]
    chunk = deflate.compress(bytes(mib)) + deflate.flush(zlib.Z_FULL_FLUSH)
    parts += [chunk] * (zeros // mib)
    parts.append(deflate.compress(tail) + deflate.flush(zlib.Z_FINISH))
    crc, zero = zlib.crc32(head), bytes(mib)
    for _ in range(zeros // mib):
        crc = zlib.crc32(zero, crc)
    crc = zlib.crc32(tail, crc)
    size = (len(head) + zeros + len(tail)) % (1 << 32)
    return (
        b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
        + b"".join(parts)
        + struct.pack("<II", crc, size)
    )
