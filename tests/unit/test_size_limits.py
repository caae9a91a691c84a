"""What a provider keeps of a command's output and of a file it copies out
(corral.providers.size_limits): never more than the limit, and saying when it cut."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.providers.errors import FileTooLargeError
from corral.providers.size_limits import (
    CHUNK_BYTES,
    ExecOutput,
    OutputBuffer,
    copy_at_most,
    reads,
    refuse_larger,
)


def test_output_within_the_limit_is_kept_whole() -> None:
    buffer = OutputBuffer(10)
    buffer.add(b"hello")
    buffer.add("")
    buffer.add(" you")
    assert buffer.text() == ("hello you", False)


def test_output_past_the_limit_is_cut_and_said_to_be() -> None:
    buffer = OutputBuffer(5)
    for chunk in (b"hel", b"lo, world", b"!" * 1000):
        buffer.add(chunk)
    assert buffer.text() == ("hello", True)
    exactly = OutputBuffer(5)
    exactly.add("hello")
    assert exactly.text() == ("hello", False)
    exactly.add("!")
    assert exactly.text() == ("hello", True)


def test_a_cut_never_splits_a_character_and_text_chunks_count_as_utf8() -> None:
    buffer = OutputBuffer(5)
    buffer.add("ééé")  # 2 bytes each: the third does not fit whole
    assert buffer.text() == ("éé", True)
    split = OutputBuffer(5)
    split.add(b"ab" + "é€".encode())  # the cut falls inside the euro sign
    assert split.text() == ("abé", True)


def test_a_long_text_chunk_is_never_encoded_whole_to_keep_its_head() -> None:
    buffer = OutputBuffer(4)
    buffer.add("x" * 10_000_000)
    assert buffer.text() == ("xxxx", True)
    assert len(buffer._kept) == 4


def test_replacement_characters_never_take_the_text_past_the_limit() -> None:
    buffer = OutputBuffer(6)
    buffer.add(b"\xff\xfe\xfd\xfc")  # 4 invalid bytes: 12 bytes of replacement characters
    text, cut = buffer.text()
    assert cut and text == "\ufffd\ufffd" and len(text.encode()) <= 6


def test_an_exec_output_says_truncated_when_either_stream_was_cut() -> None:
    output = ExecOutput(3)
    output.stdout.add(b"abc")
    output.stderr.add(b"defg")
    result = output.result(exit_code=2, duration_s=0.5)
    assert (result.stdout, result.stderr, result.truncated) == ("abc", "def", True)
    assert (result.exit_code, result.duration_s) == (2, 0.5)


def test_a_copy_within_the_limit_is_whole(tmp_path: Path) -> None:
    data = bytes(range(256)) * 1000
    target = tmp_path / "deep" / "copy"
    assert copy_at_most(reads(io.BytesIO(data).read), target, len(data), "a") == len(data)
    assert target.read_bytes() == data


def test_a_copy_stops_one_byte_past_the_limit_however_much_more_there_is(
    tmp_path: Path,
) -> None:
    pulled = 0

    def endless() -> Iterator[bytes]:
        nonlocal pulled
        while True:  # a file that grows for ever, or whose size lied
            pulled += CHUNK_BYTES
            yield b"x" * CHUNK_BYTES

    target = tmp_path / "copy"
    with pytest.raises(FileTooLargeError) as refused:
        copy_at_most(endless(), target, 100_000, "grows.log")
    assert target.stat().st_size == 100_001
    assert pulled <= 100_000 + CHUNK_BYTES
    assert refused.value.max_bytes == 100_000
    assert "grows.log" in refused.value.message


def test_a_stated_size_over_the_limit_is_refused_and_an_unknown_one_is_not() -> None:
    refuse_larger("a", 10, 10)
    refuse_larger("a", None, 10)
    with pytest.raises(FileTooLargeError):
        refuse_larger("a", 11, 10)
