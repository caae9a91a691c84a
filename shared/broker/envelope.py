"""Reading broker messages as Celery task calls, within bounds, whatever bytes arrive.

A message on a corral queue may come from any sender: corral itself, an upstream service's
Celery or celery-node, a script that LPUSHes onto the Redis list, or an attacker. This
module turns it into a :class:`TaskCall` or raises :class:`MalformedMessageError` with a
reason code and a description of the problem that never quotes the message (it may carry a
dispatch's env values). Nothing here trusts a size, a depth or an encoding it was told:

- the raw entry, the decoded body and the decompressed body each have a byte limit, and a
  compressed body is inflated only up to the limit (a compression bomb costs the limit, not
  its inflated size);
- JSON only (``application/json``, UTF-8), without NaN or Infinity, and no deeper than a
  nesting limit (checked before any model sees it, so a message that passes validation can
  also be stored);
- both Celery message protocols: 2 (task name and id in the headers, body
  ``[args, kwargs, embed]``) and 1 (everything in the body).
"""

from __future__ import annotations

import base64
import binascii
import bz2
import json
import lzma
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from corral.shared.errors import CorralError

MAX_RAW_BYTES = 8 * 1024 * 1024
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 64


class MalformedMessageError(CorralError, ValueError):
    """The broker message cannot be read as a task call."""

    code: ClassVar[str] = "malformed_message"

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        task_name: str | None = None,
        task_id: str | None = None,
        callbacks: Any = None,
        errbacks: Any = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.task_name = task_name
        self.task_id = task_id
        # What the sender gave as link and link_error, when they could be read (untrusted).
        self.callbacks = callbacks
        self.errbacks = errbacks


@dataclass(frozen=True)
class Limits:
    """What one message may cost to read."""

    raw_bytes: int = MAX_RAW_BYTES
    body_bytes: int = MAX_BODY_BYTES
    depth: int = MAX_DEPTH


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Envelope:
    """A transport's message: headers, the body's bytes as sent, and how they are encoded."""

    body: bytes
    headers: Mapping[str, Any] = field(default_factory=dict)
    content_type: str | None = "application/json"
    content_encoding: str | None = "utf-8"
    delivery_tag: str | None = None


@dataclass(frozen=True)
class TaskCall:
    """A task call read from a message."""

    name: str
    id: str | None
    args: list[Any]
    kwargs: dict[str, Any]
    protocol: int
    # The link and link_error signatures the sender gave, as it wrote them: nothing here
    # trusts them (corral.shared.broker.callbacks reads them).
    callbacks: Any = None
    errbacks: Any = None


# -- the Redis transport's list entries ----------------------------------------------------


def parse_redis_entry(raw: bytes, limits: Limits = DEFAULT_LIMITS) -> Envelope:
    """One entry of a kombu Redis queue list, as kombu's Redis transport writes it.

    Raises:
        MalformedMessageError: not such an entry, or over a limit.
    """
    if len(raw) > limits.raw_bytes:
        raise MalformedMessageError(
            "too_large",
            f"the message is {len(raw)} bytes; the limit is {limits.raw_bytes}",
            **_names_of_oversized(raw, limits),
        )
    entry = _json(raw, limits, what="the message")
    properties = entry.get("properties") if isinstance(entry, dict) else None
    if not isinstance(properties, dict):
        raise MalformedMessageError(
            "not_an_envelope", "the message is not a kombu envelope (an object with properties)"
        )
    tag = properties.get("delivery_tag")
    body = entry.get("body") or ""
    if not isinstance(body, str):
        raise MalformedMessageError("not_an_envelope", "the envelope's body is not a string")
    encoding = properties.get("body_encoding")
    if encoding == "base64":
        try:
            decoded = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MalformedMessageError(
                "bad_body_encoding", "the body is not valid base64"
            ) from exc
    elif encoding is None:
        decoded = body.encode("utf-8", errors="surrogatepass")
    else:
        raise MalformedMessageError("bad_body_encoding", "the body encoding is not base64")
    return Envelope(
        body=decoded,
        headers=_headers(entry.get("headers")),
        content_type=_optional_str(entry.get("content-type")),
        content_encoding=_optional_str(entry.get("content-encoding")),
        delivery_tag=tag if isinstance(tag, str) else None,
    )


_KOMBU_ENTRY_START = b'{"body": "'
_EMBED_START = b'{"callbacks": '
TAIL_BYTES = 64 * 1024  # of an oversized body, the end read for its embed


def _names_of_oversized(raw: bytes, limits: Limits) -> dict[str, Any]:
    """What can be read of an entry too large to read without decoding its body: the task
    name and id its headers give, and the callbacks its body's end names; nothing when it
    is not shaped as kombu writes it.

    kombu writes the body first, base64 (no quote or backslash in it): what follows the
    body's closing quote is the envelope's small rest, read as JSON within the limits. So a
    ``corral.dispatch`` too large to read still becomes an item under its task id, and
    still answers its sender.
    """
    body_at = len(_KOMBU_ENTRY_START)
    end = raw.find(b'"', body_at) if raw.startswith(_KOMBU_ENTRY_START) else -1
    if end < 0 or raw.find(b"\\", body_at, end) >= 0:
        return {}
    rest = raw[end + 1 :].lstrip()
    if not rest.startswith(b",") or len(rest) > limits.raw_bytes:
        return {}
    try:
        entry = _json(b"{" + rest[1:], limits, what="the envelope")
    except MalformedMessageError:
        return {}
    headers = entry.get("headers") if isinstance(entry, dict) else None
    if not isinstance(headers, dict):
        return {}
    name, task_id = headers.get("task"), headers.get("id")
    found = {
        "task_name": name if isinstance(name, str) else None,
        "task_id": task_id if isinstance(task_id, str) else None,
    }
    if headers.get("compression") is None:
        found |= _embed_at_end(raw, body_at, end, limits)
    return found


def _embed_at_end(raw: bytes, body_at: int, body_end: int, limits: Limits) -> dict[str, Any]:
    """The callbacks and errbacks of the protocol 2 body between ``body_at`` and
    ``body_end`` (base64), read from its last :data:`TAIL_BYTES` alone: Celery writes the
    embed last (``[args, kwargs, {"callbacks": ...}]``). Nothing when the end is not that."""
    start = max(body_at, body_end - TAIL_BYTES)
    start += -(start - body_at) % 4  # base64 decodes from a multiple of 4 characters
    try:
        tail = base64.b64decode(raw[start:body_end], validate=True)
    except (binascii.Error, ValueError):
        return {}
    at = tail.rfind(_EMBED_START)
    try:
        text = tail[at:].decode("utf-8") if at >= 0 else ""
        embed, used = json.JSONDecoder().raw_decode(text)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return {}
    if text[used:].strip() != "]" or not isinstance(embed, dict):
        return {}
    if json_depth(embed, limit=limits.depth) > limits.depth:
        return {}
    return {"callbacks": embed.get("callbacks"), "errbacks": embed.get("errbacks")}


def _headers(headers: Any) -> Mapping[str, Any]:
    if headers is None:
        return {}
    if not isinstance(headers, dict):
        raise MalformedMessageError("bad_headers", "the message headers are not an object")
    return headers


def _optional_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


# -- Celery task messages ---------------------------------------------------------------------


def read_task(envelope: Envelope, limits: Limits = DEFAULT_LIMITS) -> TaskCall:
    """The task call in ``envelope`` (Celery message protocol 2 or 1).

    Raises:
        MalformedMessageError: with ``task_name``/``task_id`` set when the headers named them.
    """
    headers = _headers(envelope.headers)
    name, task_id = headers.get("task"), headers.get("id")
    known = {
        "task_name": name if isinstance(name, str) else None,
        "task_id": task_id if isinstance(task_id, str) else None,
    }
    try:
        body = decode_body(envelope, limits)
        if name is None:
            return _protocol_1(body)
        return _protocol_2(name, task_id, body)
    except MalformedMessageError as exc:
        raise MalformedMessageError(exc.reason, exc.message, **known) from exc


def decode_body(envelope: Envelope, limits: Limits = DEFAULT_LIMITS) -> Any:
    """The body as JSON: decompressed (bounded) if the headers say so, depth-checked."""
    if envelope.content_type not in ("application/json", None):
        raise MalformedMessageError(
            "unsupported_content_type", "only application/json messages are accepted"
        )
    if envelope.content_encoding not in ("utf-8", "utf8", None):
        raise MalformedMessageError("unsupported_content_type", "only UTF-8 bodies are accepted")
    body = envelope.body
    compression = envelope.headers.get("compression")
    if compression is not None:
        body = _inflate(body, compression, limits.body_bytes)
    if len(body) > limits.body_bytes:
        raise MalformedMessageError(
            "too_large", f"the body is {len(body)} bytes; the limit is {limits.body_bytes}"
        )
    return _json(body, limits, what="the body")


def _protocol_2(name: Any, task_id: Any, body: Any) -> TaskCall:
    if not isinstance(name, str) or not name:
        raise MalformedMessageError("no_task_name", "the task header is not a task name")
    if task_id is not None and not isinstance(task_id, str):
        raise MalformedMessageError("bad_headers", "the id header is not a string")
    if not isinstance(body, list) or len(body) not in (2, 3):
        raise MalformedMessageError(
            "bad_call_shape", "a protocol 2 body is the list [args, kwargs, embed]"
        )
    args, kwargs = body[0], body[1]
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise MalformedMessageError(
            "bad_call_shape", "a protocol 2 body's args is a list and its kwargs an object"
        )
    embed = body[2] if len(body) == 3 and isinstance(body[2], dict) else {}
    return TaskCall(
        name=name,
        id=task_id,
        args=args,
        kwargs=kwargs,
        protocol=2,
        callbacks=embed.get("callbacks"),
        errbacks=embed.get("errbacks"),
    )


def _protocol_1(body: Any) -> TaskCall:
    if not isinstance(body, dict) or not isinstance(body.get("task"), str) or not body["task"]:
        raise MalformedMessageError(
            "no_task_name", "the message names no task (no task header, no protocol 1 body)"
        )
    task_id = body.get("id")
    args, kwargs = body.get("args", []), body.get("kwargs", {})
    known = {"task_name": body["task"], "task_id": task_id if isinstance(task_id, str) else None}
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise MalformedMessageError(
            "bad_call_shape", "a protocol 1 body's args is a list and its kwargs an object", **known
        )
    return TaskCall(
        name=body["task"],
        id=known["task_id"],
        args=args,
        kwargs=kwargs,
        protocol=1,
        callbacks=body.get("callbacks"),
        errbacks=body.get("errbacks"),
    )


# -- bounded decoding -------------------------------------------------------------------------


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json(data: bytes, limits: Limits, *, what: str) -> Any:
    try:
        text = data.decode("utf-8")
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError as exc:
        raise MalformedMessageError("too_deep", f"{what} is nested too deeply") from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedMessageError("not_json", f"{what} is not UTF-8 JSON") from exc
    depth = json_depth(value, limit=limits.depth)
    if depth > limits.depth:
        raise MalformedMessageError(
            "too_deep", f"{what} is nested more than {limits.depth} levels deep"
        )
    return value


def json_depth(value: Any, *, limit: int) -> int:
    """The nesting depth of a decoded JSON value (a scalar is 0), counted up to ``limit + 1``.

    Iterative, so no value is too deep to measure.
    """
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        depth += 1
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        stack.extend((child, depth) for child in children)
    return deepest


Inflater = Callable[[bytes, int], bytes]


def _zlib(data: bytes, limit: int) -> bytes:
    inflater = zlib.decompressobj(wbits=47)  # zlib or gzip framing, detected
    return inflater.decompress(data, limit + 1)


def _bz2(data: bytes, limit: int) -> bytes:
    return bz2.BZ2Decompressor().decompress(data, limit + 1)


def _lzma(data: bytes, limit: int) -> bytes:
    return lzma.LZMADecompressor().decompress(data, limit + 1)


# kombu's content types for its built-in compressions, and their aliases.
_INFLATERS: dict[str, Inflater] = {
    **dict.fromkeys(("application/x-gzip", "gzip", "zlib"), _zlib),
    **dict.fromkeys(("application/x-bz2", "bzip2", "bzip"), _bz2),
    **dict.fromkeys(("application/x-lzma", "lzma", "xz"), _lzma),
}


def _inflate(data: bytes, compression: Any, limit: int) -> bytes:
    inflater = _INFLATERS.get(compression) if isinstance(compression, str) else None
    if inflater is None:
        known = ", ".join(sorted(k for k in _INFLATERS if "/" in k))
        raise MalformedMessageError(
            "unsupported_compression", f"unsupported compression; accepted: {known}"
        )
    try:
        inflated = inflater(data, limit)
    except (zlib.error, OSError, EOFError, lzma.LZMAError, ValueError) as exc:
        raise MalformedMessageError("bad_compression", "the body does not decompress") from exc
    if len(inflated) > limit:
        raise MalformedMessageError(
            "too_large", f"the body inflates past the limit of {limit} bytes"
        )
    return inflated
