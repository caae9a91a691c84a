"""``corral dispatch --wait``: follow an item to its end, one progress line per state
change on standard error, and say early and plainly when nothing is going to run it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from corral.cli.output import echo_work_text, fail
from corral.shared.store.models import ItemState

POLL_S = 0.3


def progress(message: str) -> None:
    """A progress line on standard error; the work's words in it escaped on a terminal."""
    echo_work_text(message, err=True)


def describe(view: dict[str, Any], *, current: bool = True) -> str:
    """The state, and what goes with it: pool and queue, sandbox, exit code, error (those
    of the item now: only for its current state, and routing's, which stays)."""
    state = ItemState(view["state"])
    words = [state.value]
    if not current:
        if state == ItemState.ROUTED and view["queue"]:
            words.append(f"to pool {view['pool'] or view['pool_id']} on queue {view['queue']}")
        return " ".join(words)
    if state == ItemState.ROUTED:
        words.append(f"to pool {view['pool'] or view['pool_id']} on queue {view['queue']}")
    if state in (ItemState.AWAITING_CLAIM, ItemState.RUNNING) and view["sandbox"]:
        words.append(f"in sandbox {view['sandbox']['id']}")
    if view["exit_code"] is not None:
        words.append(f"exit {view['exit_code']}")
    if view["duration_s"] is not None:
        words.append(f"{view['duration_s']:.2f} s")
    if view["error"]:
        words.append(f"{view['error']['code']}: {view['error']['message']}")
    return " ".join(words)


def stall_hint(view: dict[str, Any], waited_s: float, *, in_process: bool) -> str | None:
    """What to do about an item that has stayed in its state this long, if anything."""
    state = ItemState(view["state"])
    if state == ItemState.RECEIVED:
        return _received_hint(view, waited_s, in_process=in_process)
    if state == ItemState.ROUTED:
        provider = view["queue"].split(".")[1] if view["queue"] else "NAME"
        return (
            f"still routed after {waited_s:.0f} s: no provider worker takes queue "
            f"{view['queue']}; start `corral worker --provider {provider}`"
        )
    if state == ItemState.WAITING_CAPACITY:
        return "every pool that can run it is full: it waits for a slot (`corral status`)"
    if state == ItemState.AWAITING_CLAIM:
        return (
            f"its sandbox has not claimed it after {waited_s:.0f} s: can the sandbox reach "
            f"the api (CORRAL_CONTROL_URL)? `corral logs {view['id']}` shows what it said"
        )
    return None


def _received_hint(view: dict[str, Any], waited_s: float, *, in_process: bool) -> str:
    not_before = (view.get("timestamps") or {}).get("not_before")
    if not_before:  # requeued, waiting out its lease's back-off: nothing to start
        return (
            f"requeued (attempt {view['attempts']} ended): its lease backs off until "
            f"{not_before}, then the re-drive routes it again (`corral show {view['id']}`)"
        )
    if in_process:
        return (
            f"still received after {waited_s:.0f} s: no `corral dev` with this state "
            "directory has picked it up (it routes items from other shells at each "
            "re-drive); start `corral dev`, or point CORRAL_BROKER_URL and "
            "CORRAL_DATABASE_URL at your deployment"
        )
    return (
        f"still received after {waited_s:.0f} s: no scheduler has routed it; start "
        "`corral scheduler` (and `corral beat` for re-drives)"
    )


@dataclass
class Follower:
    """Prints each state change of an item once (from its lifecycle events, so that none
    is missed between two looks) and one hint for a state it stays in too long."""

    stall_s: float
    in_process: bool
    last_event: int = 0
    state: str | None = None
    since: float = field(default_factory=time.monotonic)
    hinted: set[str] = field(default_factory=set)

    def see(self, view: dict[str, Any], changes: list[dict[str, Any]]) -> None:
        created = datetime.fromisoformat(view["timestamps"]["created_at"])
        for change in changes:
            self.last_event = change["id"]
            shown = view if change["state"] == view["state"] else {**view, "state": change["state"]}
            elapsed = (change["at"] - created).total_seconds()
            progress(f"[{elapsed:6.1f}s] {describe(shown, current=shown is view)}")
        now = time.monotonic()
        if view["state"] != self.state:
            self.state, self.since = view["state"], now
            return
        waited = now - self.since
        if waited >= self.stall_s and self.state not in self.hinted:
            hint = stall_hint(view, waited, in_process=self.in_process)
            if hint:
                progress(f"[{'':>6} ] {hint}")
            self.hinted.add(view["state"])


def warn_if_nothing_consumes(rt: Any) -> None:
    """Say at once when nothing will take the item: no `corral dev` behind an in-process
    broker, or no scheduler answering on a shared one."""
    from corral.cli.api_target import api_answers, api_target
    from corral.cli.status import consumers, in_process_broker

    if in_process_broker(rt.settings.broker_url):
        target = api_target(rt.settings)
        if not api_answers(target):
            progress(
                f"warning: the broker is in-process (memory://) and no `corral dev` answers at "
                f"{target.url} ({target.url_from}): nothing will run this item. Start "
                "`corral dev` in another shell with this CORRAL_STATE_DIR, or set "
                "CORRAL_BROKER_URL and CORRAL_DATABASE_URL to your deployment's"
            )
        return
    try:
        nodes = consumers()
    except Exception as exc:  # the broker cannot be reached
        progress(f"warning: the broker did not answer ({type(exc).__name__})")
        return
    if not any("dispatch" in queues for queues in nodes.values()):
        progress(
            "warning: no scheduler answered (Celery inspect, 1 s), so nothing consumes the "
            "dispatch queue; start `corral scheduler`"
        )


def follow_item(rt: Any, item_id: str, timeout_s: float) -> dict[str, Any]:
    """The item's final view, printing progress until then.

    Raises:
        typer.Exit: still not ended after ``timeout_s``.
    """
    from corral.cli.inspect import item_view
    from corral.cli.status import in_process_broker
    from corral.scheduler.admin.views import load_state_changes

    warn_if_nothing_consumes(rt)
    follower = Follower(
        stall_s=max(10.0, 2 * rt.settings.redrive_interval_s + 2),
        in_process=in_process_broker(rt.settings.broker_url),
    )
    deadline = time.monotonic() + timeout_s
    while True:
        changes = load_state_changes(rt.db, item_id, after=follower.last_event)
        view = item_view(rt.db, item_id, max_attempts=rt.settings.max_attempts)
        follower.see(view, changes)
        if ItemState(view["state"]).is_final:
            # Its last change committed with its final state: read after the view, it is in.
            follower.see(view, load_state_changes(rt.db, item_id, after=follower.last_event))
            return view
        if time.monotonic() > deadline:
            raise fail(f"{item_id} is still {view['state']} after {timeout_s:.0f}s", code=1)
        time.sleep(POLL_S)
