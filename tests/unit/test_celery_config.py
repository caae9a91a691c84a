"""corral's Celery configuration: the delivery guarantees every task is written for."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import typer
from pydantic import ValidationError

from corral.cli.flower import flower_arguments
from corral.cli.processes import RoutineAtDebug, quiet_task_lines
from corral.providers.registry import default_registry
from corral.shared.broker.celery_app import app, celery_config, configure
from corral.shared.broker.queues import provider_queues, provision_queue
from corral.shared.settings import CoreSettings


def test_celery_is_configured_for_at_least_once_json_delivery() -> None:
    config = celery_config(CoreSettings(broker_url="redis://127.0.0.1:6379/0"))
    assert config["task_serializer"] == "json"
    assert config["accept_content"] == ["json"]
    assert config["task_acks_late"] is True
    assert config["task_reject_on_worker_lost"] is True
    assert config["worker_prefetch_multiplier"] == 1
    assert config["task_ignore_result"] is True
    assert config["worker_send_task_events"] is True
    queue_names = {queue.name for queue in config["task_queues"]}
    assert {
        "dispatch",
        "maintenance",
        "provision.local",
        "provision.local.gpu",
        "provision.docker",
        "provision.docker.gpu",
    } <= queue_names


def test_queues_exist_for_the_providers_corral_has_and_no_other() -> None:
    config = celery_config(CoreSettings())
    provision = {q.name for q in config["task_queues"]} - {"dispatch", "maintenance"}
    expected = {name for p in default_registry.known_ids() for name in provider_queues(p)}
    assert provision == expected
    assert {q.split(".")[1] for q in provision} == set(default_registry.known_ids())


def test_every_task_is_named_corral_dot_something() -> None:
    configure(CoreSettings(broker_url="memory://"))
    ours = {name for name in app.tasks if not name.startswith("celery.")}
    assert ours == {
        "corral.dispatch",
        "corral.route",
        "corral.provision",
        "corral.terminate",
        "corral.terminate_many",
        "corral.redrive",
        "corral.reaper.sweep",
        "corral.warm.provision",
        "corral.warm.tick",
        "corral.outcomes.deliver",
    }


def test_queue_names_follow_the_capability_class() -> None:
    assert provision_queue("docker", gpu=False) == "provision.docker"
    assert provision_queue("modal", gpu=True) == "provision.modal.gpu"
    assert provider_queues("local") == ["provision.local", "provision.local.gpu"]


def test_a_key_prefix_isolates_deployments_sharing_one_redis() -> None:
    config = celery_config(
        CoreSettings(
            broker_url="redis://127.0.0.1:6379/0", broker_key_prefix="blue:", provision_lease_s=300
        )
    )
    assert config["broker_transport_options"] == {
        "global_keyprefix": "blue:",
        "visibility_timeout": 600,  # a lost worker's messages come back after two leases
    }


def test_prefetch_is_disabled_on_redis_so_queue_length_is_the_backlog() -> None:
    on_redis = celery_config(CoreSettings(broker_url="redis://127.0.0.1:6379/0"))
    assert on_redis["worker_disable_prefetch"] is True
    assert on_redis["worker_prefetch_multiplier"] == 1 and on_redis["task_acks_late"] is True
    # Celery supports it on Redis only (and warns elsewhere): off for the in-process broker.
    assert celery_config(CoreSettings(broker_url="memory://"))["worker_disable_prefetch"] is False


def test_every_queue_is_bound_to_the_corral_exchange_by_its_own_name() -> None:
    config = celery_config(CoreSettings(broker_url="redis://127.0.0.1:6379/0"))
    for queue in config["task_queues"]:
        assert (queue.exchange.name, queue.exchange.type) == ("corral", "direct")
        assert queue.routing_key == queue.name
    keys = [queue.routing_key for queue in config["task_queues"]]
    assert len(set(keys)) == len(keys)  # one queue per routing key: no publish reaches two
    assert config["task_default_exchange"] == "corral"
    assert config["task_default_routing_key"] == "dispatch"


ROUTES = [
    ("corral.dispatch", "dispatch"),
    ("corral.route", "dispatch"),
    ("corral.redrive", "maintenance"),
    ("corral.terminate", "maintenance"),
    ("corral.terminate_many", "maintenance"),
    ("corral.reaper.sweep", "maintenance"),
    ("corral.unlisted", "dispatch"),
]


def test_tasks_are_routed_by_queue_name_through_the_default_exchange() -> None:
    configure(CoreSettings(broker_url="memory://"))
    router = app.amqp.router
    for name, queue in ROUTES:
        route = router.route({}, name)
        assert (route["queue"].name, route["exchange"], route["routing_key"]) == (queue, "", queue)
    route = router.route({"queue": "provision.acme-cloud.gpu"}, "corral.provision")
    assert (route["exchange"], route["routing_key"]) == ("", "provision.acme-cloud.gpu")
    # a queue made on the fly (a third-party provider's) is bound like the declared ones
    assert route["queue"].exchange.name == "corral"
    assert route["queue"].routing_key == "provision.acme-cloud.gpu"


@pytest.mark.parametrize("name", ["celery.worker.strategy", "celery.app.trace"])
def test_a_provider_worker_logs_no_line_per_task_but_its_failures(name: str) -> None:
    logger = logging.getLogger(name)
    level = logger.level
    try:
        quiet_task_lines()
        assert not logger.isEnabledFor(logging.INFO)  # received, succeeded, retry
        assert logger.isEnabledFor(logging.ERROR)  # a task that raised
    finally:
        logger.setLevel(level)


def record(msg: str, level: int = logging.INFO) -> logging.LogRecord:
    return logging.LogRecord("celery.beat", level, __file__, 1, msg, ("a", "b"), None)


def test_routine_task_lines_are_debug_lines_and_the_rest_keep_their_level() -> None:
    routine = RoutineAtDebug(("Scheduler: Sending due task %s (%s)",))
    root = logging.getLogger()
    level = root.level
    try:
        root.setLevel(logging.INFO)
        sent = record("Scheduler: Sending due task %s (%s)")
        assert routine.filter(sent) is False and sent.levelname == "DEBUG"
        other = record("beat: Starting...")
        assert routine.filter(other) is True and other.levelno == logging.INFO
        error = record("Scheduler: Sending due task %s (%s)", logging.ERROR)
        assert routine.filter(error) is True and error.levelno == logging.ERROR
        root.setLevel(logging.DEBUG)  # a process that logs at DEBUG writes them, as DEBUG
        sent = record("Scheduler: Sending due task %s (%s)")
        assert routine.filter(sent) is True and sent.levelno == logging.DEBUG
    finally:
        root.setLevel(level)


def test_task_events_can_be_switched_off_for_busy_workers() -> None:
    assert celery_config(CoreSettings(task_events=False))["worker_send_task_events"] is False


def test_a_key_prefix_on_rabbitmq_is_refused_with_the_vhost_advice() -> None:
    with pytest.raises(ValidationError) as raised:
        CoreSettings(broker_url="amqp://guest:guest@127.0.0.1:5672//", broker_key_prefix="d1:")
    assert "vhost" in str(raised.value)
    assert CoreSettings(broker_url="amqp://guest:guest@127.0.0.1:5672/d1").broker_key_prefix == ""


def test_an_invalid_setting_stops_a_command_with_its_variable_and_status_2() -> None:
    env = {
        **os.environ,
        "CORRAL_BROKER_URL": "amqp://127.0.0.1:1//",
        "CORRAL_BROKER_KEY_PREFIX": "d1:",
        "CORRAL_API_PORT": "eighty",
    }
    answer = subprocess.run(
        [sys.executable, "-m", "corral", "worker", "--maintenance"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert answer.returncode == 2
    assert "CORRAL_API_PORT: Input should be a valid integer" in answer.stderr
    assert "eighty" not in answer.stderr  # values are not echoed (one may be a secret)
    assert "Traceback" not in answer.stderr


def test_flower_passes_the_rabbitmq_management_api_and_refuses_anything_else() -> None:
    arguments = flower_arguments(
        5555, "127.0.0.1", read_only=True, broker_api="http://u:p@rabbit:15672/api/"
    )
    assert "--broker_api=http://u:p@rabbit:15672/api/" in arguments
    assert not any(
        a.startswith("--broker_api")
        for a in flower_arguments(5555, "127.0.0.1", read_only=True, broker_api=None)
    )
    with pytest.raises(typer.BadParameter, match="management API"):
        flower_arguments(5555, "127.0.0.1", read_only=True, broker_api="rabbit:15672")


def test_the_periodic_tasks_send_no_task_events_for_flower() -> None:
    from corral.worker import tasks

    assert tasks.redrive_task.send_events is False
    assert tasks.reaper_sweep.send_events is False
    assert tasks.provision.send_events is True  # the work's tasks are still shown
