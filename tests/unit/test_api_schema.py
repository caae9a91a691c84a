"""``/openapi.json`` documents every answer: each route's success answers have a schema of
their own (a model with its fields, not an empty object), and the dispatch body is there."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel

from corral.scheduler.api import (
    admin_api,
    capacity_api,
    interactive_api,
    items_api,
    runner_api,
    secrets_api,
    warm_api,
    webhooks_api,
)
from corral.scheduler.api.app import create_app
from corral.shared.messages import DispatchRequest

# Routes whose success answer is a file, not JSON: documented as such (with its media type)
# instead of a model.
BINARY = {
    ("/v1/work-items/{item_id}/bundle", "GET"): "application/gzip",
    ("/v1/sessions/{session_id}/files/{path}", "GET"): "application/octet-stream",
}


@pytest.fixture(scope="module")
def api() -> FastAPI:
    return create_app()


def operations(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (path, method.upper(), operation)
        for path, methods in schema["paths"].items()
        for method, operation in methods.items()
    ]


def resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref is None:
        return node
    name = ref.removeprefix("#/components/schemas/")
    resolved: dict[str, Any] = schema["components"]["schemas"][name]
    return resolved


def test_every_route_is_documented_with_a_model_of_its_answer(api: FastAPI) -> None:
    documented = {(path, method) for path, method, _ in operations(api.openapi())}
    # The runner protocol's, the warm runner's and the admin routes come in through routers.
    included = [
        *runner_api.router.routes,
        *warm_api.router.routes,
        *admin_api.router.routes,
        *capacity_api.router.routes,
        *interactive_api.router.routes,
        *items_api.router.routes,
        *webhooks_api.router.routes,
        *secrets_api.router.routes,
    ]
    routes = [r for r in [*api.routes, *included] if isinstance(r, APIRoute)]
    # path_format: the path as documented (a {path:path} parameter is {path} there).
    assert {(r.path_format, m) for r in routes for m in r.methods} == documented
    for route in routes:
        if any((route.path_format, method) in BINARY for method in route.methods):
            continue
        model = route.response_model
        assert isinstance(model, type) and issubclass(model, BaseModel), route.path


def test_every_success_answer_has_a_schema_with_its_fields(api: FastAPI) -> None:
    schema = api.openapi()
    for path, method, operation in operations(schema):
        successes = {code: r for code, r in operation["responses"].items() if code[0] == "2"}
        assert successes, (method, path)
        for code, response in successes.items():
            where = (method, path, code)
            if (path, method) in BINARY:
                binary = response["content"][BINARY[(path, method)]]["schema"]
                assert binary == {"type": "string", "format": "binary"}, where
                continue
            body = resolve(schema, response["content"]["application/json"]["schema"])
            assert body.get("type") == "object" and body.get("properties"), where
            assert body.get("additionalProperties") is False, where  # extra="forbid"
            assert set(body["required"]) == set(body["properties"]), where  # always sent


def test_dispatch_documents_its_body_and_both_answers(api: FastAPI) -> None:
    schema = api.openapi()
    operation = schema["paths"]["/v1/dispatch"]["post"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert resolve(schema, body)["properties"].keys() == DispatchRequest.model_fields.keys()
    answers = {
        code: resolve(schema, operation["responses"][code]["content"]["application/json"]["schema"])
        for code in ("200", "202")
    }
    assert answers["200"] == answers["202"]
    assert answers["202"]["properties"].keys() == {"id", "created", "state", "error"}


def test_the_dispatch_models_agree_with_the_answers_that_share_them(api: FastAPI) -> None:
    """The claim answer holds the dispatch message's work models: the schema FastAPI makes of
    them is the one the dispatch body refers to, so neither replaces the other."""
    made = get_openapi(title=api.title, version=api.version, routes=api.routes)
    components = made["components"]["schemas"]
    message = DispatchRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    shared = set(message["$defs"]) & set(components)
    assert {"ShellWork", "CodeWork"} <= shared
    for name in shared:
        assert components[name] == message["$defs"][name], name
