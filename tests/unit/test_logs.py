"""Process logs: JSON lines with the record's ids, and nothing secret-shaped in them."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from corral.shared import logs
from corral.shared.logs import (
    JsonFormatter,
    RedactingFilter,
    WhereaboutsFilter,
    redact,
    remember,
    whereabouts,
)

TOKEN = "crt_" + "Zk3-9_qP" * 5  # the shape of a registration token
SESSION = "crs_" + "m2Xv8Lq_" * 5


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(f"corral.test.{id(stream)}")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    yield logger, stream
    logger.removeHandler(handler)


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_token_written_to_a_log_line_comes_out_redacted(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = captured
    logger.warning("provider said: bad token %s", TOKEN, extra={"sandbox_id": "sb-1"})
    logger.info("runner session %s", SESSION)
    logger.error("call failed", extra={"detail": f"Authorization: Bearer {SESSION}"})

    text = stream.getvalue()
    assert TOKEN not in text and SESSION not in text
    assert "crt_" not in text and "crs_" not in text
    first, second, third = lines(stream)
    assert first["message"] == "provider said: bad token [redacted]"
    assert first["sandbox_id"] == "sb-1"
    assert second["message"] == "runner session [redacted]"
    assert third["detail"] == "Authorization: Bearer [redacted]"


def test_an_exception_carrying_a_token_is_redacted_too(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = captured
    try:
        raise RuntimeError(f"the provider echoed {TOKEN}")
    except RuntimeError:
        logger.exception("provision failed", extra={"work_item_id": "wi-1", "org_id": "acme"})
    [line] = lines(stream)
    assert TOKEN not in stream.getvalue()
    assert "RuntimeError: the provider echoed [redacted]" in str(line["exception"])
    assert (line["work_item_id"], line["org_id"], line["level"]) == ("wi-1", "acme", "ERROR")


@pytest.mark.parametrize(
    ("secret_text", "kept"),
    [
        ("CORRAL_E2B_API_KEY=e2b_0123456789abcdef0123", "CORRAL_E2B_API_KEY=[redacted]"),
        ("key dtn_" + "0a" * 32 + " used", "key [redacted] used"),
        ('{"api_key": "k-81f2c9d0"}', '{"api_key": "[redacted]"}'),
        ("password=hunter2hunter2", "password=[redacted]"),
        ("postgresql://corral:s3cr3t@db:5432/corral", "postgresql://[redacted]@db:5432/corral"),
        ("key AKIAIOSFODNN7EXAMPLE used", "key [redacted] used"),
        ("ghp_" + "a" * 36, "[redacted]"),
        ("sk-ant-" + "b" * 30, "[redacted]"),
        ("-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA PRIVATE KEY-----", "[redacted]"),
        ("{'api_key': 'abcd1234efgh'}", "{'api_key': '[redacted]'}"),
        ("env={'DB_PASSWORD': 'hunter2hunter2'}", "env={'DB_PASSWORD': '[redacted]'}"),
        ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI", "AWS_SECRET_ACCESS_KEY=[redacted]"),
        ("SECRET_KEY=abcdefgh1234", "SECRET_KEY=[redacted]"),
        ("redis://:s3cr3tpw@redis:6379/0", "redis://[redacted]@redis:6379/0"),
        ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "Authorization: Basic [redacted]"),
        ("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.sig_abc", "jwt [redacted]"),
        ("org key cok_" + "K" * 43 + " refused", "org key [redacted] refused"),
        ("enrol cre_" + "e" * 43, "enrol [redacted]"),
        ("channel crw_" + "w" * 43, "channel [redacted]"),
    ],
)
def test_credential_shapes_are_redacted(secret_text: str, kept: str) -> None:
    assert redact(secret_text) == kept


def test_ordinary_lines_are_left_alone() -> None:
    for line in (
        "sandbox sb-1 ended: deadline",
        "token expired after 900 s",
        "heartbeat_timeout_s is 60",
        "reaper sweep done",
        "running basic connectivity checks",
        "max_tokens=4096",
    ):
        assert redact(line) == line


def test_fields_holding_containers_are_redacted_all_the_way_down(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = captured
    data = {"args": [{"env": {"API_TOKEN": "SECRET_VALUE_abc123"}}], "exc": f"bad {TOKEN}"}
    logger.error("Received invalid task message", extra={"data": data})
    assert "SECRET_VALUE_abc123" not in stream.getvalue() and TOKEN not in stream.getvalue()
    [line] = lines(stream)
    assert line["data"] == {"args": [{"env": {"API_TOKEN": "[redacted]"}}], "exc": "bad [redacted]"}


def test_an_idempotency_key_is_an_id_and_stays_readable() -> None:
    from corral.shared.logs import _redact_value, redact

    assert redact("dispatch idempotency_key=build-4711 api_key=abcd1234") == (
        "dispatch idempotency_key=build-4711 api_key=[redacted]"
    )
    assert _redact_value({"idempotency_key": "build-4711", "secret_key": "abcd1234"}) == {
        "idempotency_key": "build-4711",
        "secret_key": "[redacted]",
    }


def test_a_record_about_a_remembered_item_or_sandbox_carries_its_org_and_pool() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(WhereaboutsFilter())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(f"corral.test.where.{id(stream)}")
    logger.addHandler(handler)
    logger.propagate = False
    remember(org_id="acme", pool_id="pool-1", work_item_id="wi-w1", sandbox_id="sb-w1")
    try:
        logger.warning("about the item", extra={"work_item_id": "wi-w1"})
        logger.warning("about the sandbox", extra={"sandbox_id": "sb-w1"})
        logger.warning("said by the caller", extra={"sandbox_id": "sb-w1", "org_id": "other"})
        logger.warning("never seen here", extra={"work_item_id": "wi-unknown"})
    finally:
        logger.removeHandler(handler)
    item, sandbox, own, unknown = lines(stream)
    assert (item["org_id"], item["pool_id"]) == ("acme", "pool-1")
    assert (sandbox["org_id"], sandbox["pool_id"]) == ("acme", "pool-1")
    assert (own["org_id"], own["pool_id"]) == ("other", "pool-1")  # the record's own wins
    assert "org_id" not in unknown


def test_the_remembered_places_are_bounded() -> None:
    for number in range(logs._REMEMBERED + 10):
        remember(org_id="o", pool_id=None, work_item_id=f"wi-bound-{number}")
    assert whereabouts("wi-bound-0") is None
    assert whereabouts(f"wi-bound-{logs._REMEMBERED + 9}") == {"org_id": "o", "pool_id": None}


def test_json_lines_carry_no_terminal_escapes(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    # uvicorn's records carry a coloured copy of their message; Celery colours its own.
    logger, stream = captured
    logger.info(
        "Started server process [%d]",
        42,
        extra={"color_message": "Started server process [\x1b[36m%d\x1b[0m]", "kind": "\x1b[1mx"},
    )
    logger.warning("\x1b[31mred\x1b[0m and \x1b]0;title\x07 plain")

    text = stream.getvalue()
    assert "\x1b" not in text and "\\u001b" not in text
    first, second = lines(stream)
    assert first["message"] == "Started server process [42]"
    assert "color_message" not in first
    assert first["kind"] == "x"
    assert second["message"] == "red and  plain"
