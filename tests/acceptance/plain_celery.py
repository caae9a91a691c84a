"""An upstream service with Celery alone: run as a script, in isolated mode (``python -I``),
so that neither the repository nor corral is importable (an import of corral fails here).

``python -I plain_celery.py send`` sends each message of the JSON configuration on its
standard input (broker, backend, key prefix, callbacks queue, timeout, messages) as
``corral.dispatch`` with a
``link`` and a ``link_error`` callback, then waits on each ``AsyncResult.get()`` and prints
one JSON line per message: its task id, state, and the value ``get()`` returned or the
exception it raised (type, module, first argument).

``python -I plain_celery.py worker CONFIG LOG`` runs a Celery worker of the upstream's
callbacks queue; each callback it runs appends a JSON line to LOG.
"""

from __future__ import annotations

import importlib.abc
import json
import sys
from typing import Any


class _NoCorral(importlib.abc.MetaPathFinder):
    """corral is not installed here: importing it fails."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "corral" or name.startswith("corral."):
            raise ImportError(f"{name}: an upstream service has Celery, not corral")


sys.meta_path.insert(0, _NoCorral())

from celery import Celery, signature  # noqa: E402 - after the import guard


def _app(config: dict[str, Any]) -> Celery:
    app = Celery("upstream", broker=config["broker"], backend=config["backend"])
    app.conf.broker_transport_options = {"global_keyprefix": config["prefix"]}
    app.conf.task_serializer = "json"
    app.conf.accept_content = ["json"]
    return app


def send(config: dict[str, Any]) -> None:
    app = _app(config)
    queue = config["callbacks_queue"]
    sent = []
    for message in config["messages"]:
        result = app.send_task(
            "corral.dispatch",
            args=[message],
            queue="dispatch",
            link=signature("upstream.done", args=("linked",), queue=queue),
            link_error=signature("upstream.failed", args=("errback",), queue=queue),
        )
        sent.append(result)
    for result in sent:
        line: dict[str, Any] = {"task_id": result.id}
        try:
            line["value"] = result.get(timeout=config["timeout"])
        except Exception as exc:  # what get() raises is what is checked
            line["raised"] = type(exc).__name__
            line["module"] = type(exc).__module__
            line["record"] = exc.args[0] if exc.args else None
        line["state"] = result.state
        print(json.dumps(line), flush=True)
    loaded = sorted(name for name in sys.modules if name.split(".")[0] == "corral")
    assert not loaded, loaded


def worker(config: dict[str, Any], log_path: str) -> None:
    app = _app(config)

    def note(kind: str, first: Any, second: Any) -> None:
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(json.dumps({"kind": kind, "first": first, "second": second}) + "\n")

    @app.task(name="upstream.done")
    def done(record: Any, tag: str) -> None:
        note("done", record, tag)

    @app.task(name="upstream.failed")
    def failed(task_id: Any, tag: str) -> None:
        note("failed", task_id, tag)

    app.worker_main(
        ["worker", "-Q", config["callbacks_queue"], "--pool", "solo", "--loglevel", "INFO"]
    )


if __name__ == "__main__":
    if sys.argv[1] == "send":
        send(json.load(sys.stdin))
    else:
        worker(json.loads(sys.argv[2]), sys.argv[3])
