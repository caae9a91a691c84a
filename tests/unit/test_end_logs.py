"""What is kept of a sandbox's own log: cleaned, redacted of the item's values, bounded; and
the providers' bounded reads of a log's end."""

from __future__ import annotations

import os
from pathlib import Path

from corral.providers.size_limits import file_tail, log_tail
from corral.shared.end_logs import MAX_BYTES, MAX_LINES, SHORT_CHARS, keep, short_form
from corral.shared.store.sealing import env_values

SECRET = "hunter2-horse-battery-staple"


def test_escapes_controls_and_carriage_returns_are_removed() -> None:
    raw = (
        "\x1b[31mred\x1b[0m plain\n"  # colours
        "\x1b]0;a title\x07after the title\n"  # OSC, BEL-terminated
        "\x1b]8;;https://x.example\x1b\\link\x1b]8;;\x1b\\\n"  # a hyperlink, ST-terminated
        "10%\r50%\r100% done\r\n"  # a progress bar
        "bell\x07 nul\x00 del\x7f c1\x85 bidi\u202eevil\u202c sep\u2028x\n"
        "a\ttab\n"
        "\n   \n"  # blank lines
        "\x9b2Jcleared\n"  # an 8-bit CSI
    )
    kept = keep(raw)
    assert kept == (
        "red plain\nafter the title\nlink\n100% done\nbell nul del c1 bidievil sepx\na tab\ncleared"
    )


def test_the_item_s_own_values_are_redacted_even_split_by_escapes() -> None:
    key = "-----BEGIN KEY-----\nMIIEvQIBADANBgkqhkiG9w0B\n-----END KEY-----"
    raw = (
        f"connecting with {SECRET}\n"
        f"hunter2-\x1b[1mhorse-battery-staple\n"  # an escape inside the value
        "the key's middle: MIIEvQIBADANBgkqhkiG9w0B\n"
        "short values stay: on 1\n"
        "Authorization: Bearer abcdefgh12345678\n"  # secret-shaped, not the item's
    )
    kept = keep(raw, secrets=[SECRET, key, "on", "1"])
    assert kept is not None
    assert SECRET not in kept and "horse-battery" not in kept
    assert "MIIEvQIBADANBgkqhkiG9w0B" not in kept
    assert "abcdefgh12345678" not in kept
    assert kept.splitlines()[:4] == [
        "connecting with [redacted]",
        "[redacted]",
        "the key's middle: [redacted]",
        "short values stay: on 1",
    ]


def test_the_last_lines_are_kept_within_the_byte_limit() -> None:
    many = "".join(f"line {n}\n" for n in range(1000))
    kept = keep(many)
    assert kept is not None
    assert kept.splitlines() == [f"line {n}" for n in range(1000 - MAX_LINES, 1000)]

    wide = "".join(f"{n:04d}" + "w" * 300 + "\n" for n in range(40))
    kept = keep(wide)
    assert kept is not None and len(kept.encode()) <= MAX_BYTES
    assert kept.splitlines()[-1].startswith("0039")
    assert all(len(line) == 304 for line in kept.splitlines())  # whole lines only

    one = "x" * 100_000 + "the end"
    kept = keep(one)
    assert kept is not None and len(kept.encode()) <= MAX_BYTES
    assert kept.endswith("the end")


def test_a_read_cut_inside_a_line_drops_that_line() -> None:
    # The read began in the middle of a value: its end must not be kept.
    raw = "battery-staple was the value\nthe reason\n"
    assert keep(raw, secrets=[SECRET], cut=True) == "the reason"
    assert keep("only a partial line", cut=True) is None
    assert keep("\n \n\x1b[0m\n") is None


def test_the_short_form_is_one_line_of_the_last_lines() -> None:
    assert short_form("a\nb\nc\nd\ne\nf") == "last lines: b | c | d | e | f"
    long = short_form("y" * 5000)
    assert len(long) == len("last lines: ") + SHORT_CHARS
    assert long.startswith("last lines: ...")


def test_env_values_are_every_env_and_binding_value() -> None:
    payload = {
        "env": {"A": "one"},
        "toolchain": {"env": {"B": "two"}},
        "egress": {"secret_bindings": {"C": {"host": "h", "value": "three"}}},
    }
    assert sorted(env_values(payload)) == ["one", "three", "two"]


def test_log_tail_holds_the_end_and_stops_at_its_read_limit() -> None:
    chunks = (bytes([65 + n % 26]) * 1000 + b"\n" for n in range(10_000))
    tail = log_tail(chunks, max_lines=3, max_bytes=2500, read_limit=50_000)
    lines = tail.splitlines()
    assert len(tail.encode()) <= 2500 and len(lines) == 3
    # Reading stopped at 50,000 bytes: the 50th chunk (index 49) was the last read.
    assert lines[-1] == chr(65 + 49 % 26) * 1000


def test_file_tail_reads_a_regular_file_s_end_only(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    log.write_bytes(b"x" * 10_000_000 + b"\nlast one\n")
    assert file_tail(log, max_lines=5, max_bytes=64) == "x" * 54 + "\nlast one\n"
    assert file_tail(tmp_path / "missing", max_lines=5, max_bytes=64) is None

    secret = tmp_path / "secret"
    secret.write_text("the worker's own secret\n")
    link = tmp_path / "link.log"
    link.symlink_to(secret)
    assert file_tail(link, max_lines=5, max_bytes=64) == ""
    hard = tmp_path / "hard.log"
    os.link(secret, hard)
    assert file_tail(hard, max_lines=5, max_bytes=64) == ""
    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    assert file_tail(fifo, max_lines=5, max_bytes=64) == ""  # and it did not block
