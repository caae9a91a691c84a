"""corral's Redis transport: which list entries it delivers, and that Celery's app uses it.

The delivery itself (BRPOP, RPOP, dead letters in the database) is exercised on real Redis
in tests/integration/test_redis_transport.py.
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import pytest
from kombu import Connection
from kombu.transport import redis as kombu_redis

from corral.shared.broker.celery_app import CorralConnection, app, configure
from corral.shared.broker.envelope import MalformedMessageError
from corral.shared.broker.redis_transport import (
    GuardedRedisTransport,
    check_kombu_message,
    kombu_payload,
)
from corral.shared.settings import CoreSettings


def entry(body: bytes = b"[[], {}, {}]", **changes: Any) -> dict[str, Any]:
    """A list entry as kombu's Redis transport writes it."""
    payload: dict[str, Any] = {
        "body": base64.b64encode(body).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"lang": "py", "task": "corral.redrive", "id": str(uuid.uuid4())},
        "properties": {
            "correlation_id": "c",
            "reply_to": "",
            "delivery_mode": 2,
            "delivery_info": {"exchange": "corral", "routing_key": "maintenance"},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    payload.update(changes)
    return payload


def raw(payload: Any) -> bytes:
    return json.dumps(payload).encode()


def test_a_kombu_entry_is_delivered_as_kombu_decodes_it() -> None:
    payload = entry()
    assert kombu_payload(raw(payload)) == payload


def with_properties(**changes: Any) -> dict[str, Any]:
    payload = entry()
    payload["properties"].update(changes)
    return payload


GZIPPED_GARBAGE = entry(body=b"not gzip data", headers={"compression": "application/x-gzip"})
KOMBU_TYPED_GARBAGE = entry(
    properties={
        "delivery_tag": "t",
        "delivery_info": {},
        "x": {"__type__": "datetime", "__value__": "not a date"},
    }
)
BAD_BASE64 = with_properties(body_encoding="base64") | {"body": "!!not base64!!"}


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        pytest.param(b"\xff\xfe\x00 random bytes", "not_json", id="random-bytes"),
        pytest.param(b"not json at all", "not_json", id="not-json"),
        pytest.param(b"", "not_json", id="empty"),
        pytest.param(b"42", "not_an_envelope", id="number"),
        pytest.param(b'["a", "list"]', "not_an_envelope", id="list"),
        pytest.param(b'{"body": "e30="}', "not_an_envelope", id="no-properties"),
        pytest.param(raw(BAD_BASE64), "bad_body_encoding", id="bad-base64"),
        pytest.param(raw(entry(headers=["not", "a", "dict"])), "bad_headers", id="headers-list"),
        pytest.param(raw(with_properties(delivery_tag=None)), "not_an_envelope", id="no-tag"),
        pytest.param(raw(with_properties(delivery_tag={"a": 1})), "not_an_envelope", id="dict-tag"),
        pytest.param(raw(with_properties(delivery_info=None)), "not_an_envelope", id="no-info"),
        pytest.param(
            raw(with_properties(delivery_info={"exchange": "corral"})),
            "not_an_envelope",
            id="info-without-routing-key",
        ),
        pytest.param(raw(with_properties(priority="high")), "not_an_envelope", id="priority-text"),
        pytest.param(raw(with_properties(priority=1000)), "not_an_envelope", id="priority-big"),
        pytest.param(raw(entry(**{"content-type": 7})), "not_an_envelope", id="type-number"),
        pytest.param(raw(GZIPPED_GARBAGE), "bad_compression", id="compression-garbage"),
        pytest.param(raw(KOMBU_TYPED_GARBAGE), "not_json", id="kombu-typed-garbage"),
        pytest.param(b"x" * (9 * 1024 * 1024), "too_large", id="too-large"),
        pytest.param(b"[" * 100 + b"]" * 100, "too_deep", id="too-deep"),
    ],
)
def test_what_cannot_be_a_kombu_message_is_refused_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(MalformedMessageError) as refused:
        kombu_payload(data)
    assert refused.value.reason == reason
    assert "not a date" not in refused.value.message  # never quotes the message


def test_a_fanout_message_is_checked_like_a_list_entry() -> None:
    check_kombu_message(entry())
    for message in (42, [], {"properties": {}}, with_properties(delivery_info="x")):
        with pytest.raises(MalformedMessageError):
            check_kombu_message(message)


def test_celerys_connection_uses_corrals_transport_for_redis_urls_only() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://127.0.0.1:6380/0"):
        connection = CorralConnection(url)
        assert connection.get_transport_cls() is GuardedRedisTransport
        assert issubclass(GuardedRedisTransport, kombu_redis.Transport)
        assert connection.as_uri().startswith(url.split(":")[0] + "://")  # Flower reads this
    assert CorralConnection("rediss://h:6380/0").ssl  # kombu's rediss default is kept
    assert CorralConnection("memory://").get_transport_cls() is not GuardedRedisTransport


def test_corrals_app_connects_through_corrals_connection() -> None:
    configure(CoreSettings(broker_url="redis://127.0.0.1:6379/0"))
    try:
        with app.connection_for_read() as connection:
            assert isinstance(connection, CorralConnection)
            assert connection.transport.driver_type == "redis"  # worker_disable_prefetch
            assert isinstance(connection.transport, GuardedRedisTransport)
        # kombu's pool registry keeps corral's connections apart from a plain one's
        plain = Connection("redis://127.0.0.1:6379/0")
        assert plain.__eqhash__() != CorralConnection("redis://127.0.0.1:6379/0").__eqhash__()
    finally:
        configure(CoreSettings(broker_url="memory://"))


def test_the_workers_transport_reads_entries_within_the_configured_limits(tmp_path: Any) -> None:
    from corral.shared import runtime

    settings = CoreSettings(state_dir=tmp_path, max_message_bytes=1024, max_message_depth=3)
    runtime.install(runtime.Runtime.from_settings(settings))
    try:
        with pytest.raises(MalformedMessageError) as big:
            kombu_payload(raw(entry(b"[[" + b"1, " * 2000 + b"1], {}, {}]")))
        assert big.value.reason == "too_large"
        # the worker consumer reads each body within the same limits (depth among them)
        assert runtime.message_limits().depth == 3
        assert kombu_payload(raw(entry()))["properties"]["delivery_tag"]
    finally:
        runtime.current().db.dispose()
        runtime.reset()
