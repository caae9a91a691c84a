"""Fuzzing the api on real PostgreSQL: Hypothesis-made dispatch bodies, and schemathesis
requests (valid and invalid ones) made from the api's own OpenAPI schema. Neither may ever
get a 5xx; schemathesis also checks each answer against the schema (content type, and the
documented shape of each status, errors included). Bounded in examples so that the suite
stays quick on a loaded machine; nothing is stored between runs (no example database)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
)

from corral.shared.store.db import Database
from tests.integration.api_clients import ClientFactory
from tests.integration.test_api import admin_headers, awaiting_item

# Text as hostile as JSON can carry: NUL and other controls, lone surrogates, anything.
hostile_text = st.text(
    alphabet=st.characters(categories=["Cc", "Cs", "L", "N", "P", "S", "Z"]), max_size=20
)
identifiers = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", fullmatch=True)
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),  # infinities too: they become 1e999-like Infinity tokens
)
json_values = st.recursive(
    st.none() | st.booleans() | numbers | hostile_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(hostile_text, inner, max_size=3),
    max_leaves=12,
)


def either(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value, sometimes hostile text, sometimes any JSON."""
    return st.one_of(good, good, hostile_text, json_values)


works = st.one_of(
    st.fixed_dictionaries({"kind": st.just("shell"), "command": either(st.text(min_size=1))}),
    st.fixed_dictionaries(
        {"kind": st.just("code"), "code": either(st.text(min_size=1))},
        optional={"language": either(st.just("python")), "arguments": json_values},
    ),
    json_values,
)
dispatch_messages = st.fixed_dictionaries(
    {
        "org": either(identifiers),
        "project": either(identifiers),
        "profile": either(st.just("default")),
        "work": works,
    },
    optional={
        "version": either(st.just(1)),
        "env": st.dictionaries(hostile_text, either(hostile_text), max_size=3),
        "resources": st.fixed_dictionaries(
            {}, optional={k: either(numbers) for k in ("cpu", "memory_mb", "timeout_s", "gpu")}
        ),
        "agent_card": st.fixed_dictionaries(
            {},
            optional={
                "runtimes": st.lists(st.fixed_dictionaries({"kind": either(st.just("native"))})),
                "requires": st.lists(st.fixed_dictionaries({"kind": either(st.just("git"))})),
            },
        ),
        "toolchain": st.fixed_dictionaries(
            {},
            optional={
                "install_commands": st.lists(hostile_text, max_size=2),
                "env": st.dictionaries(hostile_text, hostile_text, max_size=2),
            },
        ),
        "egress": st.fixed_dictionaries(
            {}, optional={"allow_network": either(st.booleans()), "allowed_hosts": json_values}
        ),
        "region": hostile_text,
        "arch": hostile_text,
        "provider": either(identifiers),
        "sandbox_features": st.lists(either(st.just("pause-resume")), max_size=2),
        "idempotency_key": hostile_text,
        "surprise": json_values,
    },
)


@pytest.fixture
def client(make_client: ClientFactory) -> TestClient:
    return make_client()


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=st.one_of(dispatch_messages, dispatch_messages, json_values))
def test_generated_dispatch_bodies_never_get_a_5xx(make_client: ClientFactory, body: Any) -> None:
    client = make_client()
    # json.dumps escapes lone surrogates and writes Infinity: the api gets both as sent.
    content = json.dumps(body).encode()
    answer = client.post("/v1/dispatch", content=content, headers=admin_headers())
    assert answer.status_code in (200, 202, 422), answer.text
    if answer.status_code == 422:
        assert answer.json()["error"] == "invalid_message"
        return
    # What was accepted reads back (its payload came through the database intact).
    view = client.get(f"/v1/work-items/{answer.json()['id']}", headers=admin_headers())
    assert view.status_code == 200, view.text


@dataclass
class FuzzedApi:
    client: TestClient
    runner: dict[str, str]


@pytest.fixture
def fuzzed_api(make_client: ClientFactory, pg_db: Database) -> FuzzedApi:
    # No rate limits here: the fuzzer would mostly meet 429s.
    client = make_client(runner_rate_per_s=0, runner_address_rate_per_s=0, register_rate_per_s=0)
    _, token = awaiting_item(pg_db, f"fuzz-{uuid.uuid4().hex[:8]}")
    registered = client.post("/v1/runner/register", json={"token": token})
    session = registered.json()["session_token"]
    return FuzzedApi(client, {"Authorization": f"Bearer {session}"})


def fuzz(operation: Any, headers: dict[str, str]) -> None:
    """Up to 12 valid or invalid cases of ``operation``, each answer checked."""
    cases = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
    )

    @settings(
        max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(case=cases)
    def call(case: Any) -> None:
        case.call_and_validate(
            headers=headers,
            checks=[not_a_server_error, content_type_conformance, response_schema_conformance],
        )

    call()


# A result bundle upload is bytes: fuzzed as bytes, which the api refuses as no bundle.
schemathesis.serializer.alias("application/gzip", "application/octet-stream")


def test_the_api_answers_what_its_schema_says_and_never_5xx(fuzzed_api: FuzzedApi) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzzed_api.client.app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    for operation in operations:  # about half a minute here, all of them
        runner = operation.path.startswith("/v1/runner/")
        fuzz(operation, fuzzed_api.runner if runner else admin_headers())
