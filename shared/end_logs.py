"""What corral keeps of a sandbox's own log when the sandbox ended before its runner reported:
its last lines, cleaned, redacted and bounded (docs/dispatch.md#why-a-sandbox-ended).

The text is the provider's log of the sandbox (:class:`corral.providers.base.SupportsEndLog`),
written by the sandbox: hostile. So it is

1. cleaned: terminal escape sequences removed, each line shown as a terminal would leave it
   after its carriage returns, other control and format characters dropped (a tab becomes a
   space), blank lines dropped;
2. redacted: the item's own env and secret-binding values, each whole and each of its lines
   (of at least :data:`MIN_SECRET` characters), then whatever looks like a secret
   (:func:`corral.shared.logs.redact`); cleaned first, so that escapes cannot hide a value;
3. bounded: the last :data:`MAX_LINES` lines, of them at most :data:`MAX_BYTES` bytes.

A text as long as the provider was asked for may begin inside a line; that first line is
dropped, so that the end of a value cut at the read's start is never kept.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable

from corral.shared.logs import redact

MAX_LINES = 40
MAX_BYTES = 4096
# The short form appended to an item's error: its last lines, at most this many characters.
SHORT_LINES = 5
SHORT_CHARS = 1000
MIN_SECRET = 4  # shorter values ("1", "on") are not redacted: they would blank the log

_ESCAPES = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor moves
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC: titles, hyperlinks
    r"|\x1b[PX^_][^\x1b]*(?:\x1b\\)?"  # DCS, SOS, PM, APC strings
    r"|\x1b[ -/]*[0-~]"  # the other escapes
    r"|\x9b[0-?]*[ -/]*[@-~]"  # an 8-bit CSI
)
_DROPPED = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})  # controls, format (bidi), separators


def keep(raw: str, *, secrets: Iterable[str] = (), cut: bool = False) -> str | None:
    """``raw`` as it is kept (cleaned, redacted of ``secrets``, bounded); None when no line
    is left. ``cut``: ``raw`` may begin inside a line (its first line is dropped)."""
    lines = [_clean_line(line) for line in _ESCAPES.sub("", raw).split("\n")]
    if cut:
        lines = lines[1:]
    shown = [line for line in lines if line.strip()][-MAX_LINES:]
    if not shown:
        return None
    kept = redact("\n".join(shown), values=secret_fragments(secrets))
    return _last_bytes(kept.split("\n")[-MAX_LINES:], MAX_BYTES)


def short_form(end_log: str) -> str:
    """``last lines: ...``: the end log's last :data:`SHORT_LINES` lines on one line, at most
    :data:`SHORT_CHARS` characters of them (the end kept)."""
    lines = end_log.split("\n")[-SHORT_LINES:]
    joined = " | ".join(line.strip() for line in lines)
    if len(joined) > SHORT_CHARS:
        joined = "..." + joined[-(SHORT_CHARS - 3) :]
    return f"last lines: {joined}"


def secret_fragments(values: Iterable[str]) -> set[str]:
    """What to redact for ``values``: each one, and each line of a value of several lines (a
    log line may hold one line of a key), of at least :data:`MIN_SECRET` characters."""
    fragments = set()
    for value in values:
        for part in (value, *value.splitlines()):
            stripped = part.strip()
            if len(stripped) >= MIN_SECRET:
                fragments.add(stripped)
    return fragments


def _clean_line(line: str) -> str:
    # What a terminal shows last of a line its carriage returns rewrote (progress bars).
    line = line.rstrip("\r").rsplit("\r", 1)[-1]
    return "".join(
        " " if char == "\t" else char
        for char in line
        if char == "\t" or unicodedata.category(char) not in _DROPPED
    ).rstrip()


def _last_bytes(lines: list[str], limit: int) -> str:
    """The last of ``lines`` that fit in ``limit`` bytes of UTF-8 (newlines counted); a last
    line longer than that alone is kept by its end."""
    kept: list[str] = []
    size = 0
    for line in reversed(lines):
        cost = len(line.encode()) + (1 if kept else 0)
        if size + cost > limit:
            if not kept:
                kept.append(line.encode()[-limit:].decode(errors="ignore"))
            break
        kept.append(line)
        size += cost
    return "\n".join(reversed(kept))
