"""JavaScript code items through real processes: dispatched over HTTP, routed to a local
pool, run by the real runner with the host's node inside a real bubblewrap sandbox."""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from tests.acceptance.conftest import shell
from tests.acceptance.stack import Stack
from tests.conftest import require


@pytest.fixture(scope="module")
def setup_org(stack: Stack) -> str:
    """An org of this module's own (the session's database is shared)."""
    return stack.make_org("js-code")


def _code(org: str, language: str, source: str, **arguments: Any) -> dict[str, Any]:
    message = shell(org, "unused")
    message["work"] = {
        "kind": "code",
        "language": language,
        "code": source,
        "arguments": arguments,
    }
    return message


def _run(stack: Stack, *messages: dict[str, Any]) -> list[dict[str, Any]]:
    ids = []
    for message in messages:
        status, body = stack.request("POST", "/v1/dispatch", message)
        assert status == 202, body
        ids.append(body["id"])
    return stack.wait_final(ids)


def test_a_javascript_item_returns_its_json_result(stack: Stack, setup_org: str) -> None:
    require(shutil.which("node") is not None, "node")
    source = (
        "const os = require('os');\n"
        "async function main(args) {\n"
        "  await new Promise((resolve) => setTimeout(resolve, 5));\n"
        "  console.log('node', process.version, 'in', os.hostname());\n"
        "  return {square: args.n * args.n, label: args.label, major: process.versions.node};\n"
        "}\n"
    )
    [view] = _run(stack, _code(setup_org, "javascript", source, n=7, label="js"))
    assert view["state"] == "succeeded", view
    assert view["result"]["square"] == 49 and view["result"]["label"] == "js"
    assert view["result"]["major"].startswith("20.")
    status, logs = stack.request("GET", f"/v1/work-items/{view['id']}/logs")
    assert status == 200
    stdout = [line["line"] for line in logs["lines"] if line["stream"] == "stdout"]
    assert any(line.startswith("node v20") for line in stdout), stdout


def test_a_throw_fails_as_a_python_raise_does(stack: Stack, setup_org: str) -> None:
    require(shutil.which("node") is not None, "node")
    js, py = _run(
        stack,
        _code(setup_org, "javascript", "function main() { throw new RangeError('no'); }"),
        _code(setup_org, "python", "def main():\n    raise ValueError('no')\n"),
    )
    assert (js["state"], py["state"]) == ("failed", "failed")
    assert js["error"]["code"] == py["error"]["code"] == "work_failed"
    assert js["error"]["message"] == "main() raised RangeError: no"
    assert py["error"]["message"] == "main() raised ValueError: no"
    assert js["exit_code"] == py["exit_code"] == 1


def test_a_result_that_is_not_json_is_refused(stack: Stack, setup_org: str) -> None:
    require(shutil.which("node") is not None, "node")
    [view] = _run(
        stack, _code(setup_org, "javascript", "const main = () => ({when: new Date(0)});")
    )
    assert view["state"] == "failed", view
    assert view["error"]["code"] == "work_failed"
    assert view["error"]["message"] == (
        "main() returned a value that is not JSON: the result.when is a Date, not a plain object"
    )
    assert view["result"] is None
