"""``corral dev --demo``: a few items dispatched end to end, and a table of what happened."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any

from corral.cli.inspect import format_table
from corral.providers.local.isolation import find_bwrap
from corral.scheduler.admin import pools as admin
from corral.shared.runtime import Runtime
from corral.shared.store.models import AuthMode, ItemState

CODE = """
def main(numbers, power):
    return {"sum_of_powers": sum(n ** power for n in numbers)}
"""


@dataclass(frozen=True)
class DemoItem:
    name: str
    message: dict[str, Any]
    expect: ItemState


def demo_items(org: str, *, network: bool) -> list[DemoItem]:
    def message(**fields: Any) -> dict[str, Any]:
        return {
            "org": org,
            "project": "web",
            "profile": "default",
            "egress": {"allow_network": network},
            **fields,
        }

    return [
        DemoItem(
            "shell command",
            message(work={"kind": "shell", "command": "echo hello from $(hostname)"}),
            ItemState.SUCCEEDED,
        ),
        DemoItem(
            "python code + arguments",
            message(
                work={"kind": "code", "code": CODE, "arguments": {"numbers": [1, 2, 3], "power": 2}}
            ),
            ItemState.SUCCEEDED,
        ),
        DemoItem(
            "needs a GPU",
            message(
                work={"kind": "shell", "command": "nvidia-smi"},
                agent_card={"requires": [{"kind": "gpu"}]},
            ),
            ItemState.DISPATCH_ERROR,
        ),
        DemoItem(
            "failing install step",
            message(
                work={"kind": "shell", "command": "echo never runs"},
                toolchain={"install_commands": ["echo fetching kit", "exit 3"]},
            ),
            ItemState.FAILED,
        ),
    ]


def run_demo(rt: Runtime, api_url: str, admin_token: str, *, timeout_s: float = 50) -> bool:
    """Dispatch the demo items through the api; print the table. True when all went as expected."""
    org = f"demo-{uuid.uuid4().hex[:8]}"
    admin.create_profile(
        rt.db, admin.ProfileCreate(name="default", model="demo-model", auth_mode=AuthMode.BYOK)
    )
    admin.create_pool(
        rt.db,
        admin.PoolCreate(
            org_id=org, name="local", provider_id="local", priority=10, max_concurrent=4
        ),
    )
    network = find_bwrap("bwrap") is None
    if network:
        print(
            "note: bubblewrap is not installed, so `corral dev` runs the demo sandboxes "
            "unisolated, as your own processes, in the host network (isolation: off; never as "
            "root); apt-get install bubblewrap isolates them"
        )
    items = demo_items(org, network=network)
    ids = [_post(api_url, "/v1/dispatch", admin_token, item.message)["id"] for item in items]
    views = _await_final(api_url, admin_token, ids, timeout_s)
    print_table(items, views)
    print("web console: `corral dev` serves it at <api URL>/console and prints that URL")
    return all(view["state"] == item.expect for item, view in zip(items, views, strict=True))


def _await_final(
    api_url: str, token: str, ids: list[str], timeout_s: float
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        views = [_get(api_url, f"/v1/work-items/{item_id}", token) for item_id in ids]
        if all(ItemState(v["state"]).is_final for v in views) or time.monotonic() > deadline:
            for view in views:
                view["output"] = _output(api_url, token, view)
            return views
        time.sleep(0.2)


def _output(api_url: str, token: str, view: dict[str, Any]) -> str:
    if view["error"]:
        # The code first: it is what `corral show`, the api and the docs name.
        return f"{view['error']['code']}: {view['error']['message']}"
    if view["result"] is not None:
        return json.dumps(view["result"])
    lines = _get(api_url, f"/v1/work-items/{view['id']}/logs", token)["lines"]
    stdout = [line["line"] for line in lines if line["stream"] == "stdout"]
    return stdout[-1] if stdout else ""


def print_table(items: list[DemoItem], views: list[dict[str, Any]]) -> None:
    header = ("item", "pool", "queue", "state", "exit", "seconds", "output or error")
    rows = [
        (
            item.name,
            view["pool"] or "-",
            view["queue"] or "-",
            view["state"],
            "-" if view["exit_code"] is None else str(view["exit_code"]),
            "-" if view["duration_s"] is None else f"{view['duration_s']:.2f}",
            " ".join(view["output"].split()),
        )
        for item, view in zip(items, views, strict=True)
    ]
    print(format_table(header, rows))


def _request(url: str, token: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")  # noqa: S310
    request.add_header("Authorization", f"Bearer {token}")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310 - our own api
        loaded: dict[str, Any] = json.loads(answer.read())
    return loaded


def _post(api_url: str, path: str, token: str, body: dict[str, Any]) -> dict[str, Any]:
    return _request(api_url + path, token, body)


def _get(api_url: str, path: str, token: str) -> dict[str, Any]:
    return _request(api_url + path, token)
