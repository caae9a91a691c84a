"""Why a sandbox never claimed (issue 35, Reasons): a local pool whose entrypoint writes its
reason to stderr and exits 3 before any claim, through real processes (api, scheduler,
``corral worker --provider local`` with bubblewrap, maintenance and beat). Each attempt ends as
``sandbox_lost``; the item fails after its attempts, and its error, ``corral show`` and the
api's answer (read with the org's own key) say the reason line. A hostile entrypoint (8 MB of
output, escape sequences, its own env secret echoed) is kept bounded, cleaned and redacted."""

from __future__ import annotations

import json
import subprocess
import uuid
from typing import Any

import pytest

from tests.acceptance.conftest import shell
from tests.acceptance.stack import CORRAL, Stack

REASON = "corral-test: /opt/tool is missing, the entrypoint cannot start"
SECRET = "hunter2-horse-battery-staple"

PLAIN = f"echo 'starting the entrypoint'; echo '{REASON}' >&2; exit 3"
HOSTILE = (
    "head -c 8000000 /dev/zero | tr '\\0' x; echo; "  # one line of 8 MB
    'i=0; while [ $i -lt 200 ]; do echo "noise $i"; i=$((i+1)); done; '
    "printf '\\033[31mred\\033[0m \\033]0;a title\\007done\\n'; "  # colours and a title
    'echo "connecting with $PASSPHRASE now" >&2; '  # the item's own secret, echoed
    f"echo '{REASON}' >&2; exit 3"
)


def _org_with_pool(stack: Stack, script: str) -> tuple[str, str]:
    """An org of its own (its breaker counts its failures alone) with one local pool whose
    entrypoint runs ``script``, and a read-and-dispatch key of the org: (org, key)."""
    org = f"reasons-{uuid.uuid4().hex[:8]}"
    profile = {"name": "default", "model": "m", "auth_mode": "byok"}
    assert stack.request("POST", "/v1/admin/profiles", profile)[0] in (201, 409)
    pool = {
        "org_id": org,
        "name": "talking",
        "provider_id": "local",
        "max_concurrent": 4,
        "sandbox_config": {"command": ["sh", "-c", script]},
    }
    status, body = stack.request("POST", "/v1/admin/pools", pool)
    assert status == 201, body
    made = {"name": "reasons", "scopes": ["dispatch", "read"]}
    status, body = stack.request("POST", f"/v1/admin/orgs/{org}/keys", made)
    assert status == 201, body
    return org, str(body["key"])


def _failed(stack: Stack, org: str, key: str, **fields: Any) -> dict[str, Any]:
    status, answer = stack.request("POST", "/v1/dispatch", shell(org, "true", **fields), token=key)
    assert status == 202, answer
    [view] = stack.wait_final([answer["id"]], timeout_s=120)
    status, view = stack.request("GET", f"/v1/work-items/{answer['id']}", token=key)
    assert status == 200, view
    return dict(view)


def _show(stack: Stack, item_id: str, *args: str) -> str:
    shown = subprocess.run(
        [*CORRAL, "show", item_id, *args],
        env=stack.env,
        cwd=stack.state_dir,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return shown.stdout


@pytest.mark.timeout(300)
def test_a_never_claiming_entrypoint_s_stderr_line_is_the_item_s_reason(stack: Stack) -> None:
    org, key = _org_with_pool(stack, PLAIN)

    view = _failed(stack, org, key)

    assert view["state"] == "failed", view
    assert view["error"]["code"] == "sandbox_lost"
    message = view["error"]["message"]
    assert message.startswith("the sandbox ended before the work reported: exited with code 3")
    assert message.endswith(f"; last lines: starting the entrypoint | {REASON}")
    assert view["sandbox"]["end_log"] == f"starting the entrypoint\n{REASON}"
    text = _show(stack, view["id"])
    assert f"last lines: starting the entrypoint | {REASON}" in text  # the error
    block = "end log    the last lines of its provider's log of the sandbox\n"
    assert f"{block}  starting the entrypoint\n  {REASON}" in text
    assert (
        json.loads(_show(stack, view["id"], "--format", "json"))["sandbox"]["end_log"]
        == (view["sandbox"]["end_log"])
    )
    # Another org's key does not see it.
    _, stranger = _org_with_pool(stack, "exit 0")
    assert stack.request("GET", f"/v1/work-items/{view['id']}", token=stranger)[0] == 404


@pytest.mark.timeout(300)
def test_a_hostile_entrypoint_s_log_is_kept_bounded_cleaned_and_redacted(stack: Stack) -> None:
    org, key = _org_with_pool(stack, HOSTILE)

    view = _failed(stack, org, key, env={"PASSPHRASE": SECRET})

    assert (view["state"], view["error"]["code"]) == ("failed", "sandbox_lost"), view
    end_log = view["sandbox"]["end_log"]
    lines = end_log.split("\n")
    assert len(lines) == 40 and len(end_log.encode()) <= 4096
    assert lines[0] == "noise 163"
    assert lines[-3:] == ["red done", "connecting with [redacted] now", REASON]
    message = view["error"]["message"]
    last = ["noise 198", "noise 199", "red done", "connecting with [redacted] now", REASON]
    assert message.endswith("; last lines: " + " | ".join(last))
    shown = _show(stack, view["id"], "--format", "json")
    for text in (end_log, message, shown):
        assert SECRET not in text
        assert "\x1b" not in text and "\x07" not in text and "\\u001b" not in text
