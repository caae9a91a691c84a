"""Every answer of the api carries nosniff, no-referrer and DENY, a 500 included, and an
answer's own value of one of them stays."""

from __future__ import annotations

from fastapi import FastAPI, Response
from fastapi.testclient import TestClient

from corral.scheduler.api import security_headers


def app() -> FastAPI:
    api = FastAPI()

    @api.get("/boom")
    def boom() -> None:
        raise RuntimeError("boom")

    @api.get("/framed")
    def framed() -> Response:
        return Response("ok", headers={"X-Frame-Options": "SAMEORIGIN"})

    security_headers.install(api)
    return api


def test_an_unhandled_errors_500_carries_the_headers() -> None:
    with TestClient(app(), raise_server_exceptions=False) as client:
        answer = client.get("/boom")
    assert answer.status_code == 500
    assert answer.headers["x-content-type-options"] == "nosniff"
    assert answer.headers["referrer-policy"] == "no-referrer"
    assert answer.headers["x-frame-options"] == "DENY"


def test_a_header_the_answer_sets_is_kept_and_not_repeated() -> None:
    with TestClient(app()) as client:
        answer = client.get("/framed")
        missing = client.get("/no-such-route")
    assert answer.headers.get_list("x-frame-options") == ["SAMEORIGIN"]
    assert answer.headers["x-content-type-options"] == "nosniff"
    assert missing.status_code == 404
    assert missing.headers["x-content-type-options"] == "nosniff"
