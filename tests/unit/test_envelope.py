"""Reading broker messages within bounds: what kombu and Celery write reads back; every
malformed shape is a MalformedMessageError with its reason, never another exception."""

from __future__ import annotations

import base64
import bz2
import json
import lzma
import zlib
from typing import Any

import pytest

from corral.shared.broker.envelope import (
    DEFAULT_LIMITS,
    Envelope,
    Limits,
    MalformedMessageError,
    json_depth,
    parse_redis_entry,
    read_task,
)


def entry(body: bytes, headers: Any = None, **extra: Any) -> bytes:
    return json.dumps(
        {
            "body": base64.b64encode(body).decode(),
            "content-type": "application/json",
            "content-encoding": "utf-8",
            "headers": headers if headers is not None else {},
            "properties": {"body_encoding": "base64", "delivery_tag": "t1"},
            **extra,
        }
    ).encode()


def reason(raw: bytes, limits: Limits = DEFAULT_LIMITS) -> str:
    with pytest.raises(MalformedMessageError) as caught:
        read_task(parse_redis_entry(raw, limits), limits)
    return caught.value.reason


def test_protocol_2_and_1_messages_read_back() -> None:
    headers = {"task": "corral.dispatch", "id": "abc"}
    call = read_task(parse_redis_entry(entry(b'[[{"org": "a"}], {}, {}]', headers)))
    assert (call.name, call.id, call.args, call.kwargs, call.protocol) == (
        "corral.dispatch",
        "abc",
        [{"org": "a"}],
        {},
        2,
    )
    body = json.dumps({"task": "corral.route", "id": "x", "args": ["wi-1"], "kwargs": {}})
    call = read_task(parse_redis_entry(entry(body.encode())))
    assert (call.name, call.args, call.protocol) == ("corral.route", ["wi-1"], 1)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"\xff\xfe garbage", "not_json"),
        (b"", "not_json"),
        (b"42", "not_an_envelope"),
        (b"[1, 2]", "not_an_envelope"),
        (b'{"body": "x", "properties": {"body_encoding": "base64"}}', "bad_body_encoding"),
        (b'{"body": 5, "properties": {}}', "not_an_envelope"),
        (entry(b"[[], {}, {}]", headers="task"), "bad_headers"),
        (entry(b'{"a": 1}', {"task": "corral.dispatch"}), "bad_call_shape"),
        (entry(b"[5, {}, {}]", {"task": "corral.dispatch"}), "bad_call_shape"),
        (entry(b"[null, {}, {}]", {"task": "corral.dispatch"}), "bad_call_shape"),
        (entry(b"[[1]]", {"task": "corral.dispatch"}), "bad_call_shape"),
        (entry(b'{"args": []}'), "no_task_name"),
        (entry(b"[[NaN], {}, {}]", {"task": "t"}), "not_json"),
        (entry(b"[[], {}, {}]", {"task": 7}), "no_task_name"),
        (entry(b"[[], {}, {}]", {"task": "t", "compression": "brotli"}), "unsupported_compression"),
        (entry(b"not zlib", {"task": "t", "compression": "application/x-gzip"}), "bad_compression"),
    ],
)
def test_each_malformed_shape_has_its_reason(raw: bytes, expected: str) -> None:
    assert reason(raw) == expected


def test_the_task_name_and_id_are_kept_when_the_call_is_wrong() -> None:
    with pytest.raises(MalformedMessageError) as caught:
        read_task(parse_redis_entry(entry(b"[5, {}, {}]", {"task": "corral.dispatch", "id": "i"})))
    assert (caught.value.task_name, caught.value.task_id) == ("corral.dispatch", "i")


@pytest.mark.parametrize("compress", [zlib.compress, bz2.compress, lzma.compress])
def test_compressed_bodies_inflate_up_to_the_limit_and_no_further(compress: Any) -> None:
    names = {
        zlib.compress: "application/x-gzip",
        bz2.compress: "application/x-bz2",
        lzma.compress: "application/x-lzma",
    }
    headers = {"task": "t", "compression": names[compress]}
    small = compress(b"[[1], {}, {}]")
    assert read_task(parse_redis_entry(entry(small, headers))).args == [1]
    bomb = compress(b"[[" + b" " * (8 * 1024 * 1024) + b"1], {}, {}]")
    assert reason(entry(bomb, headers), Limits(body_bytes=1024 * 1024)) == "too_large"


def test_size_and_depth_limits() -> None:
    assert reason(b"x" * 2048, Limits(raw_bytes=1024)) == "too_large"
    deep = "[" * 100 + "]" * 100
    assert reason(entry(f"[{deep}, {{}}, {{}}]".encode(), {"task": "t"})) == "too_deep"
    very_deep = "[" * 100_000 + "]" * 100_000  # past the parser's own recursion limit
    assert reason(entry(f"[{very_deep}, {{}}, {{}}]".encode(), {"task": "t"})) == "too_deep"
    assert json_depth({"a": [1, {"b": []}]}, limit=10) == 4  # four containers


def test_the_error_never_quotes_the_message() -> None:
    secret = "s3cr3t-value-in-the-body"
    for raw in (secret.encode(), entry(f'{{"{secret}": 1}}'.encode(), {"task": "t"})):
        with pytest.raises(MalformedMessageError) as caught:
            read_task(parse_redis_entry(raw))
        assert secret not in str(caught.value)


def test_a_kombu_envelope_from_another_transport_reads_the_same() -> None:
    call = read_task(Envelope(body=b"[[], {}, {}]", headers={"task": "x", "id": "1"}))
    assert call.name == "x"
    with pytest.raises(MalformedMessageError):
        read_task(Envelope(body=b"[]", headers={"task": "x"}, content_type="application/x-yaml"))
