"""Process logs: one JSON object per line, carrying the ids a record names, with anything
token- or credential-shaped removed before it is written.

Records name what they are about through ``extra={"work_item_id": ..., "sandbox_id": ...,
"org_id": ...}``; those (and any other extra field) become keys of the line. The redaction
filter runs on the formatted message, the exception text and every extra value, on every
handler :func:`configure` installs, so a secret that slips into a message (a provider's
error echoing its input, a library logging a header) never reaches the output.

A record about a work item or a sandbox also carries the org and the pool it belongs to
(``org_id``, ``pool_id``), so that an operator can filter one org's lines: the places that
read an item's or a sandbox's row note where it belongs (:func:`remember`), and
:class:`WhereaboutsFilter` adds those fields to every later record that names the item or the
sandbox without them. The notes are a bounded, process-local map.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, Literal

REDACTED = "[redacted]"

# What a secret looks like here: corral's own tokens, bearer and basic credentials, key=value
# pairs whose key says secret, well-known API key shapes, URLs with a password, PEM keys.
_PATTERNS = [
    # registration, runner-session, enrolment and warm-channel tokens; org api keys
    re.compile(r"\b(?:cr[tsew]|cok)_[A-Za-z0-9_\-]{8,}"),
    re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=\-]{8,}"),
    re.compile(r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?basic)\s+[A-Za-z0-9+/=]{8,}"),
    # key=value, "key": "value", 'key': 'value', key='value': any key that names a secret,
    # including *_KEY names (SECRET_KEY, AWS_SECRET_ACCESS_KEY, PRIVATE_KEY, API_KEY).
    # (An idempotency key is an id: logs must show it, to tie a line to its item.)
    re.compile(
        r"(?i)\b(?!idempotency[_-]key\b)"
        r"([A-Za-z0-9_\-]*(?:api[_-]?key|secret|password|passwd|token|credential)s?"
        r"|[A-Za-z0-9_\-]*(?:_key|private[_-]?key))"
        r"([\"']?\s*[:=]\s*[\"']?)(?!\d+\b)([^\s\"',;&}\]]{4,})"
    ),
    re.compile(r"\be2b_[A-Za-z0-9]{16,}"),
    re.compile(r"\bdtn_[A-Za-z0-9]{16,}"),  # Daytona API keys
    re.compile(r"\bsk-[A-Za-z0-9_\-]{16,}"),  # OpenAI/Anthropic-style API keys
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),  # AWS access key ids
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"),  # GitHub tokens
    re.compile(r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]+"),  # JWTs
    re.compile(r"(?<=://)[^/\s:@]*:[^/\s@]+(?=@)"),  # [user]:password@ in URLs
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----"),
]


# A mapping key that names a secret: its value goes whatever it looks like.
_SECRET_KEY = re.compile(
    r"(?i)(api[_-]?key|secret|password|passwd|token|credential|_key$|private[_-]?key)"
)


def _secret_name(key: str) -> bool:
    return key.lower() not in _ID_NAMES and bool(_SECRET_KEY.search(key))


_ID_NAMES = frozenset({"idempotency_key", "idempotency-key"})


def redact(text: str, *, values: Iterable[str] = ()) -> str:
    """``text`` with every secret-shaped part replaced by ``[redacted]``, and every one of
    ``values`` (secrets the caller knows, whatever their shape), longest first."""
    for value in sorted(set(values), key=len, reverse=True):
        if value:
            text = text.replace(value, REDACTED)
    for pattern in _PATTERNS:
        if pattern.groups >= 3:  # key=value: keep the key, drop the value
            text = pattern.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
        elif pattern.groups == 1:  # scheme word: keep it
            text = pattern.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
        else:
            text = pattern.sub(REDACTED, text)
    return text


# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


class RedactingFilter(logging.Filter):
    """Rewrites a record in place so that no handler after it sees a secret."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        record.exc_info = None  # the redacted text stands in for the traceback
        for key, value in list(vars(record).items()):
            if key not in _STANDARD:
                setattr(record, key, _redact_value(value))
        return True


def _redact_value(value: Any) -> Any:
    """Strings redacted; containers (Celery's ``data`` extra, say) walked; other values as
    their redacted text, since their repr may hold anything."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {
            str(k): REDACTED if _secret_name(str(k)) and v else _redact_value(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_redact_value(v) for v in value]
    if value is None or isinstance(value, bool | int | float):
        return value
    return redact(str(value))


# Extras that only repeat the message for a terminal: uvicorn's coloured copy of it.
_TERMINAL_ONLY = frozenset({"color_message"})
# Terminal control sequences (colours, cursor moves): a log line is read by machines.
_ANSI = re.compile(r"\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, then the record's ids; no
    terminal escapes in any of them."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": _plain(record.getMessage()),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in _TERMINAL_ONLY and not key.startswith("_"):
                kept = value if _is_json(value) else str(value)
                line[key] = _plain(kept) if isinstance(kept, str) else kept
        if record.exc_text:
            line["exception"] = record.exc_text
        elif record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def _plain(text: str) -> str:
    """``text`` without terminal escapes (most lines have none: no regex run for them)."""
    return _ANSI.sub("", text) if "\x1b" in text else text


def _is_json(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool | list | dict)


_REMEMBERED = 20_000  # items and sandboxes whose org and pool a process keeps in mind
_whereabouts: OrderedDict[str, dict[str, str | None]] = OrderedDict()
_whereabouts_lock = threading.Lock()


def remember(
    *,
    org_id: str | None,
    pool_id: str | None,
    work_item_id: str | None = None,
    sandbox_id: str | None = None,
) -> None:
    """Note the org and pool of a work item and/or a sandbox, for the records that name it."""
    place = {"org_id": org_id, "pool_id": pool_id}
    with _whereabouts_lock:
        for key in (work_item_id, sandbox_id):
            if key:
                _whereabouts[key] = place
                _whereabouts.move_to_end(key)
        while len(_whereabouts) > _REMEMBERED:
            _whereabouts.popitem(last=False)


def whereabouts(key: str) -> dict[str, str | None] | None:
    with _whereabouts_lock:
        return _whereabouts.get(key)


class WhereaboutsFilter(logging.Filter):
    """Adds ``org_id`` and ``pool_id`` to a record that names a remembered item or sandbox."""

    def filter(self, record: logging.LogRecord) -> bool:
        if hasattr(record, "org_id") and hasattr(record, "pool_id"):
            return True
        for key in ("work_item_id", "sandbox_id"):
            named = getattr(record, key, None)
            place = whereabouts(named) if isinstance(named, str) else None
            if place is not None:
                for field, value in place.items():
                    if not hasattr(record, field):
                        setattr(record, field, value)
                break
        return True


def configure(level: str = "INFO", *, fmt: Literal["json", "text"] = "json") -> None:
    """Send this process's logs to standard error, redacted, as JSON lines (or text)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(WhereaboutsFilter())
    handler.addFilter(RedactingFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level)
