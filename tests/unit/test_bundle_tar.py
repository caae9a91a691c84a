"""The bundle reader's tar layer: each 512-byte header is checked before anything reads what
it declares, so a pax or GNU extended header, a link, a device or a base-256 size is refused
at once, and a small upload that inflates to gigabytes costs a few kB of memory."""

from __future__ import annotations

import io
import tracemalloc
from pathlib import Path
from typing import BinaryIO

import pytest

from corral.runner.bundle import build_bundle
from corral.runner.protocol import BundleLimits as RunnerLimits
from corral.runner.snapshot import take_snapshot
from corral.shared.store.bundles import BundleInvalidError, BundleLimits, read_bundle
from tests.bundle_archives import (
    BLOCK,
    file_entry,
    gzip_stream,
    header,
    manifest_blocks,
    member_blocks,
    padded,
)

LIMITS = BundleLimits(max_bytes=1_000_000, max_manifest_bytes=100_000, max_patches=10)
GIB = 1 << 30
MB = 1_000_000
SECRET_NAME = "files/s3cr3t-name"


def refused(stream: bytes) -> str:
    with pytest.raises(BundleInvalidError) as caught:
        read_bundle(io.BytesIO(stream), LIMITS)
    return caught.value.message


@pytest.mark.parametrize(
    ("typeflag", "kind"),
    [
        (b"x", "a pax extended header"),
        (b"g", "a pax global header"),
        (b"L", "a GNU long name"),
        (b"K", "a GNU long link name"),
        (b"1", "a hard link"),
        (b"2", "a symlink"),
        (b"3", "a device"),
        (b"4", "a device"),
        (b"5", "a directory"),
        (b"6", "a FIFO"),
        (b"7", "a contiguous file"),
        (b"S", "a GNU sparse file"),
        (b"V", "an unknown type"),
    ],
)
def test_a_member_that_is_not_a_plain_file_is_refused_at_its_header(
    typeflag: bytes, kind: str
) -> None:
    # It declares a payload, but the stream ends after the header: refused before reading it.
    stream = manifest_blocks() + header(SECRET_NAME, 4096, typeflag=typeflag)
    message = refused(gzip_stream(stream))
    assert message.startswith(f"member 2 is not a regular file but {kind}")
    assert "s3cr3t" not in message


def test_a_gnu_long_name_cannot_rename_the_member_after_it() -> None:
    """The old reader took the name from the `L` header: the member after it could be named
    anything, with a header that says something else."""
    stream = (
        manifest_blocks(file_entry("x", b"hi"))
        + header("././@LongLink", 8, typeflag=b"L")
        + padded(b"files/x\x00")
        + member_blocks("innocent", b"hi")
    )
    assert refused(gzip_stream(stream)).startswith("member 2 is not a regular file")


@pytest.mark.parametrize(
    ("bad_header", "words"),
    [
        (header(SECRET_NAME, 2, checksum_error=1), "member 2's header checksum is wrong"),
        (
            header(SECRET_NAME, 2, size_field=b"\x80" + (2).to_bytes(11, "big")),
            "member 2's size is not an octal number (base-256 sizes are refused)",
        ),
        (header(SECRET_NAME, 2, size_field=b"0000000002x\x00"), "member 2's size is not"),
        (header(SECRET_NAME, 2, magic=b"ustar  \x00"), "member 2 is not a POSIX ustar header"),
        (header(SECRET_NAME, 2, magic=bytes(8)), "member 2 is not a POSIX ustar header"),
        (header(b"files/\xff", 2), "member 2's name is not UTF-8"),
        (header(SECRET_NAME, 2)[:300], "the bundle's archive ends inside member 2's header"),
    ],
    ids=["checksum", "base-256", "not-octal", "gnu-magic", "v7", "not-utf-8", "truncated"],
)
def test_a_broken_header_is_refused_naming_the_member_not_its_name(
    bad_header: bytes, words: str
) -> None:
    entry = file_entry("s3cr3t-name", b"hi")
    rest = padded(b"hi") + bytes(2 * BLOCK) if len(bad_header) == BLOCK else b""
    message = refused(gzip_stream(manifest_blocks(entry) + bad_header + rest))
    assert message.startswith(words) and "s3cr3t" not in message


def test_members_after_the_end_of_the_archive_are_refused() -> None:
    """tar -i would extract what follows the end-of-archive blocks: it is no hiding place."""
    stream = manifest_blocks() + bytes(2 * BLOCK) + member_blocks(SECRET_NAME, b"hi")
    message = refused(gzip_stream(stream))
    assert message == "the bundle has data after the end of its archive"


class CountingSource(io.BytesIO):
    """The upload, counting how many of its (compressed) bytes were read."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.taken = 0

    def read(self, size: int | None = -1, /) -> bytes:
        chunk = super().read(size)
        self.taken += len(chunk)
        return chunk


def peak_allocation(source: BinaryIO) -> tuple[int, str]:
    """The most memory reading ``source`` held at once (bytes), and why it was refused."""
    tracemalloc.start()
    try:
        with pytest.raises(BundleInvalidError) as caught:
            read_bundle(source, LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, caught.value.message


def test_a_pax_header_declaring_a_gibibyte_is_refused_without_reading_it() -> None:
    """Before, tarfile read a pax header's declared size into memory: this upload of about
    1 MB took the api's memory up by twice the gibibyte."""
    stream = gzip_stream(
        manifest_blocks() + header("././@PaxHeader", GIB, typeflag=b"x"),
        zeros=GIB,
        tail=member_blocks(SECRET_NAME, b"hi") + bytes(1024),
    )
    assert len(stream) < 2 * MB
    source = CountingSource(stream)
    peak, message = peak_allocation(source)
    assert peak < 10 * MB, peak
    assert source.taken < 100_000, source.taken  # the gibibyte was never inflated
    assert message.startswith("member 2 is not a regular file but a pax extended header")


def test_gigabytes_of_zeros_after_the_end_stop_at_a_small_margin() -> None:
    """A gzip bomb of end-of-archive padding: read until the margin a tar writer's padding
    needs is passed, not to its end."""
    stream = gzip_stream(manifest_blocks(), zeros=GIB)
    source = CountingSource(stream)
    peak, message = peak_allocation(source)
    assert peak < 10 * MB, peak
    assert source.taken < 100_000, source.taken
    assert message == "the bundle has more padding after the end of its archive than tar writes"


# -- what the runner writes -----------------------------------------------------------------


def test_the_runner_writes_long_and_non_ascii_paths_as_plain_ustar(tmp_path: Path) -> None:
    base = take_snapshot(str(tmp_path), keep_texts=True)
    deep = "/".join(["d" * 40] * 3) + "/" + "f" * 60 + ".txt"  # 193 bytes as files/<path>
    (tmp_path / deep).parent.mkdir(parents=True)
    (tmp_path / deep).write_text("deep\n")
    (tmp_path / "naïve-ü.txt").write_text("ü\n")
    bundle = build_bundle(base, base_info={}, limits=RunnerLimits())
    with open(bundle.path, "rb") as source:
        contents = read_bundle(source, LIMITS)
    assert sorted(e.path for e in contents.manifest.entries) == sorted([deep, "naïve-ü.txt"])
    assert contents.manifest.refused == ()


def test_the_runner_leaves_out_a_file_whose_path_does_not_fit_and_names_it(
    tmp_path: Path,
) -> None:
    base = take_snapshot(str(tmp_path), keep_texts=True)
    long_name = "n" * 120  # no '/' to split at: over ustar's 100-byte name field
    (tmp_path / long_name).write_text("too long\n")
    (tmp_path / "short.txt").write_text("fits\n")
    (tmp_path / ("l" * 150)).symlink_to("short.txt")  # no member: its path is in the manifest
    bundle = build_bundle(base, base_info={}, limits=RunnerLimits())
    with open(bundle.path, "rb") as source:
        contents = read_bundle(source, LIMITS)
    assert sorted(e.path for e in contents.manifest.entries) == ["l" * 150, "short.txt"]
    [left_out] = contents.manifest.refused
    assert left_out.path == long_name
    assert "too long for the bundle's tar format" in left_out.reason
    assert [(r.path, r.reason) for r in bundle.refused] == [(long_name, left_out.reason)]
