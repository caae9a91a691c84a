"""``corral dev``: the embedded default, every process in one.

SQLite, Celery's in-process ``memory://`` broker, the scheduler's intake on two threads,
one embedded worker thread pool that consumes the provision and maintenance queues, the api
on TCP and its Unix socket, and a re-drive tick in place of beat. ``--demo`` dispatches a
handful of items through the api and prints what happened. With ``CORRAL_DATABASE_URL``
and ``CORRAL_BROKER_URL`` set, the same runs against PostgreSQL and Redis.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from celery.contrib.testing.worker import start_worker
from pydantic import SecretStr

from corral.cli.api_target import (
    ADMIN_TOKEN_FILE,
    API_URL_FILE,
    is_loopback,
    publish,
    withdraw,
)
from corral.cli.processes import prepare
from corral.providers.local.isolation import find_bwrap
from corral.scheduler.api.metrics import start_metrics_server
from corral.scheduler.api.server import bind_sockets, make_server
from corral.scheduler.service import start_intake
from corral.shared.broker import celery_app
from corral.shared.broker.queues import MAINTENANCE_QUEUE, provider_queues
from corral.shared.runtime import Runtime
from corral.shared.settings import CoreSettings, IntakeSettings
from corral.shared.store.liveness import ConsumerBeat, consumer_name

DEMO_STATE_PREFIX = "corral-demo-"


@dataclass(frozen=True)
class DevStack:
    runtime: Runtime
    api_url: str
    admin_token: str


def dev_settings(*, demo: bool, port: int) -> CoreSettings:
    """Settings for ``corral dev``: the environment's, made self-contained where unset."""
    base = CoreSettings()
    update: dict[str, object] = {}
    if demo and base.database_url is None:
        # A demo starts from nothing each time: its own state directory.
        update["state_dir"] = Path(tempfile.mkdtemp(prefix=DEMO_STATE_PREFIX))
    if base.admin_token is None:
        update["admin_token"] = SecretStr(secrets.token_urlsafe(24))
    if base.secret_key is None:
        update["secret_key"] = _local_secret_key(Path(str(update.get("state_dir", base.state_dir))))
    if port == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    update.update(api_port=port, control_url=f"http://127.0.0.1:{port}")
    if "console_insecure_cookie" not in base.model_fields_set and is_loopback(base.api_host):
        # Its api speaks plain http, on loopback only: a browser that keeps no Secure cookie
        # from http://127.0.0.1 (Chromium and Firefox do keep them) still logs in.
        update["console_insecure_cookie"] = True
    local = base.provider_config.get("local", {})
    if "isolation" not in local and find_bwrap(local.get("bwrap_path", "bwrap")) is None:
        # One developer's own machine, stated plainly: without bubblewrap its sandboxes run
        # unisolated, as the developer's own processes (never as root: then they are refused).
        update["provider_config"] = {**base.provider_config, "local": {**local, "isolation": "off"}}
    return base.model_copy(update=update)


def _local_secret_key(state_dir: Path) -> SecretStr:
    """The key that seals this state directory's dispatch env values when CORRAL_SECRET_KEY
    is not set: made once, kept beside the database (owner-only), so that items stored by
    one `corral dev` can be run by the next."""
    path = state_dir / "secret-key"
    state_dir.mkdir(parents=True, exist_ok=True)
    try:
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
            out.write(secrets.token_urlsafe(32))
    except FileExistsError:
        pass
    return SecretStr(path.read_text().strip())


@contextlib.contextmanager
def running_stack(settings: CoreSettings, *, concurrency: int = 8) -> Iterator[DevStack]:
    """Every corral process in this one, until the block ends."""
    rt = prepare(settings)
    sockets = bind_sockets(settings)
    server = make_server(log_level="warning")
    metrics = None
    if settings.api_metrics_port is not None:
        metrics = start_metrics_server(settings.api_metrics_host, settings.api_metrics_port)
    api_thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    api_thread.start()
    stop = threading.Event()
    ticker = threading.Thread(target=_redrive_tick, args=(settings, stop), daemon=True)
    queues = [MAINTENANCE_QUEUE, *provider_queues("local")]
    intake = start_intake(rt, concurrency=2, stop=stop, name="dev-intake")
    # The embedded worker says it consumes its queues, as `corral worker` does: else routing
    # would flag every local item as on a queue nobody serves, and no_worker fail it.
    beat = ConsumerBeat(rt.db, queues, consumer_name("dev-worker")).start(stop)
    try:
        with start_worker(
            celery_app.app,
            pool="threads",
            concurrency=concurrency,
            queues=queues,
            perform_ping_check=False,
            loglevel="WARNING",
            shutdown_timeout=30,
            hostname="dev@corral",
        ):
            _await_api(server)
            ticker.start()
            assert settings.admin_token is not None
            yield DevStack(rt, settings.control_url, settings.admin_token.get_secret_value())
    finally:
        stop.set()
        for thread in [*intake, beat]:
            thread.join(timeout=10)
        # The api stops first, so that no runner reports while its sandbox is ended (a
        # runner stopped by SIGTERM would report its work cancelled, racing the end): each
        # item then ends as its sandbox lost, by one rule, whatever the timing.
        server.should_exit = True
        api_thread.join(timeout=10)
        # The worker has stopped, so nothing makes another sandbox: end those it made.
        end_own_sandboxes(rt)
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
        for sock in sockets:
            sock.close()
        with contextlib.suppress(FileNotFoundError):
            settings.resolved_api_socket().unlink()
        rt.db.dispose()


def end_own_sandboxes(rt: Runtime) -> int:
    """End every sandbox this process's providers still hold: recorded as its sandbox lost
    (a claimed item fails, or is requeued if its lease says so; one not yet claimed runs again
    at the next start) and billed, as the reaper ends one; a sandbox without a row is
    terminated at its provider alone. The number ended."""
    from corral.providers.base import SupportsInventory
    from corral.shared.store.models import TerminationReason
    from corral.worker.termination import EndRequest, end_sandboxes

    providers = [p for p in rt.built_providers() if isinstance(p, SupportsInventory)]
    held = [(provider, managed) for provider in providers for managed in provider.list_managed()]
    if not held:
        return 0
    print(f"corral dev: ending {len(held)} sandbox(es)", file=sys.stderr, flush=True)
    requests = [
        EndRequest(managed.sandbox_id, TerminationReason.LOST, detail="corral dev stopped")
        for _, managed in held
    ]
    with contextlib.suppress(Exception):  # the database may be what failed: kill them anyway
        end_sandboxes(rt, requests, actor="dev")
    for provider in providers:  # those end_sandboxes did not end: one listing per provider
        left = {m.sandbox_id for m in provider.list_managed()}
        for owner, managed in held:
            if owner is provider and managed.sandbox_id in left:
                with contextlib.suppress(Exception):
                    provider.terminate(managed.handle)
    return len(held)


def _await_api(server: object) -> None:
    deadline = time.monotonic() + 10
    while not getattr(server, "started", False):
        if time.monotonic() > deadline:
            raise RuntimeError("the embedded api did not start within 10 s")
        time.sleep(0.02)


def _redrive_tick(settings: IntakeSettings, stop: threading.Event) -> None:
    # Beat's job in the embedded stack: re-drive items, sweep for stale sandboxes, deliver
    # the outcomes owed (with CORRAL_RESULT_BACKEND).
    while not stop.wait(settings.redrive_interval_s):
        with contextlib.suppress(Exception):
            celery_app.app.send_task("corral.redrive")
            celery_app.app.send_task("corral.reaper.sweep")
            celery_app.app.send_task("corral.warm.tick")
            celery_app.app.send_task("corral.outcomes.deliver")


def serve_forever(settings: CoreSettings) -> bool:
    """Run until SIGINT or SIGTERM; True once stopped."""
    with running_stack(settings) as stack:
        # The other commands find this api and its token through these two files.
        publish(settings.state_dir, stack.api_url, stack.admin_token)
        try:
            print(f"corral dev: api on {stack.api_url} and unix://{settings.resolved_api_socket()}")
            print(f"console: {stack.api_url}/console (log in with the admin token)")
            print(f"api URL: in {settings.state_dir / API_URL_FILE}")
            print(f"admin token: in {settings.state_dir / ADMIN_TOKEN_FILE} (readable by you only)")
            print(f"database: {settings.resolved_database_url()}")
            print("Ctrl-C (or SIGTERM) stops everything, the sandboxes it started too.", flush=True)
            await_stop_signal()
        finally:
            withdraw(settings.state_dir, stack.api_url)
    return True


def await_stop_signal() -> None:
    """Return on the first SIGINT or SIGTERM; later ones are only acknowledged, so that a
    second Ctrl-C does not cut the stop short and leave sandboxes running."""
    stopped = threading.Event()

    def on_signal(number: int, _frame: object) -> None:
        if stopped.is_set():
            print(
                "corral dev: already stopping (ending its sandboxes first)",
                file=sys.stderr,
                flush=True,
            )
        stopped.set()

    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, on_signal)
    stopped.wait()
    print("corral dev: stopping", file=sys.stderr, flush=True)
