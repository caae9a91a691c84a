"""``corral dispatch --wait``: follow an item to its end, one progress line per state
change on standard error and the work's output as it comes, say early and plainly when
nothing is going to run it, and exit with what it ended as."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from corral.cli.output import (
    EXIT_FAILED_WITHOUT_CODE,
    EXIT_NOT_DISPATCHED,
    echo_work_text,
    progress,
)
from corral.shared.store.kinds import ItemState

POLL_S = 0.3


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
    waiting = view.get("waiting") or {}
    if state == ItemState.ROUTED and waiting.get("until"):  # its provider's pace holds it
        return (
            f"routed, its create held by its provider's pace ({waiting['reason']}) until "
            f"{waiting['until']}: it goes then, nothing to start"
        )
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
            f"still received after {waited_s:.0f} s: nothing has routed it; is the `corral "
            "dev` of this state directory still running (`corral status`)?"
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


def warn_if_nothing_consumes(rt: Any) -> bool:
    """Say at once when no scheduler answers on the shared broker (Celery inspect, 1 s):
    nothing takes the dispatch queue then. Whether one answered (or could not be asked)."""
    from corral.cli.status import consumers

    try:
        nodes = consumers()
    except Exception as exc:  # the broker cannot be reached
        progress(f"warning: the broker did not answer ({type(exc).__name__})")
        return True
    if not any("dispatch" in queues for queues in nodes.values()):
        progress(
            "warning: no scheduler answered (Celery inspect, 1 s), so nothing consumes the "
            "dispatch queue; start `corral scheduler`"
        )
        return False
    return True


class ItemSource(Protocol):
    """Where a followed item is read: the database, or the api."""

    def view(self) -> dict[str, Any]:
        """The item now, as ``GET /v1/work-items/{id}`` has it."""
        ...

    def changes(self, after: int) -> list[dict[str, Any]]:
        """Its state changes after change ``after``, oldest first: ``id``, ``state``, ``at``."""
        ...

    def lines(self, after: int) -> list[dict[str, Any]]:
        """Its log lines after line ``after``: ``id``, ``stream``, ``line``."""
        ...


class WaitEndedError(Exception):
    """The wait ended before the item did: ``--timeout`` passed, or it could not be read."""


@dataclass
class Streamer:
    """Prints the work's log lines as they come (stdout's on standard output, the others on
    standard error), each once; with ``show`` False it only keeps them, for the record."""

    show: bool
    after: int = 0
    kept: list[str] = field(default_factory=list)

    def drain(self, source: ItemSource) -> None:
        while lines := source.lines(self.after):
            for line in lines:
                if self.show:
                    echo_work_text(line["line"], err=line["stream"] != "stdout")
                self.kept.append(f"[{line['stream']}] {line['line']}")
                self.after = line["id"]


def follow(
    source: ItemSource, timeout_s: float, *, stall_s: float, in_process: bool, stream: bool
) -> tuple[dict[str, Any], list[str]]:
    """The item's final view and its log lines, printing progress (and with ``stream`` its
    output) until then.

    Raises:
        WaitEndedError: still not ended after ``timeout_s``.
    """
    follower = Follower(stall_s=stall_s, in_process=in_process)
    output = Streamer(show=stream)
    deadline = time.monotonic() + timeout_s
    while True:
        changes = source.changes(follower.last_event)
        view = source.view()
        if ItemState(view["state"]).is_final:
            # Its last change and its lines committed with its final state: read after the
            # view, they are all in. The output first, then how it ended.
            output.drain(source)
            follower.see(view, changes)
            follower.see(view, source.changes(follower.last_event))
            return view, output.kept
        follower.see(view, changes)
        output.drain(source)
        if time.monotonic() > deadline:
            raise WaitEndedError(
                f"{view['id']} is still {view['state']} after {timeout_s:g} s; it goes on "
                f"(`corral cancel {view['id']}` stops it)"
            )
        time.sleep(POLL_S)


def exit_code_of(view: dict[str, Any]) -> int:
    """What ``dispatch --wait`` exits with for a final item: 0 when it succeeded, the work's
    own exit code when it ran and failed with one, else one of corral's (corral.cli.output)."""
    state = ItemState(view["state"])
    if state == ItemState.SUCCEEDED:
        return 0
    if state == ItemState.DISPATCH_ERROR:
        return EXIT_NOT_DISPATCHED
    code = view["exit_code"]
    if (view["error"] or {}).get("code") == "work_failed" and code:
        if 0 < code < 256:
            return int(code)
        if -128 < code < 0:  # ended by a signal: as a shell says it
            return 128 - int(code)
    return EXIT_FAILED_WITHOUT_CODE


@dataclass(frozen=True)
class DatabaseSource:
    """An item read from the database (the broker path: the CLI has the deployment's)."""

    rt: Any
    item_id: str

    def view(self) -> dict[str, Any]:
        from corral.scheduler.admin.views import load_item_view

        return load_item_view(self.rt.db, self.item_id, max_attempts=self.rt.settings.max_attempts)

    def changes(self, after: int) -> list[dict[str, Any]]:
        from corral.scheduler.admin.views import load_state_changes

        return load_state_changes(self.rt.db, self.item_id, after=after)

    def lines(self, after: int) -> list[dict[str, Any]]:
        from corral.scheduler.admin.views import load_log_lines

        return load_log_lines(self.rt.db, self.item_id, after=after)


@dataclass(frozen=True)
class ApiSource:
    """An item read through the api (``corral.client.Client``)."""

    client: Any
    item_id: str

    def view(self) -> dict[str, Any]:
        found: dict[str, Any] = self.client.get(self.item_id).model_dump(mode="json")
        return found

    def changes(self, after: int) -> list[dict[str, Any]]:
        events = [e for e in self.client.events(self.item_id) if e.entity == "work_item"]
        # The api numbers no event: an item's events only grow, so a position is an id.
        return [
            {"id": number, "state": event.to.value, "at": event.at}
            for number, event in enumerate(events, start=1)
            if number > after
        ]

    def lines(self, after: int) -> list[dict[str, Any]]:
        return [
            line.model_dump(mode="json") for line in self.client.logs(self.item_id, after=after)
        ]
