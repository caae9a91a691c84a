"""What a Celery sender is owed: its callbacks read hostile-safely, its result's state, and
what can still be read of a message too large to read."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import pytest

from corral.scheduler.intake import task_key
from corral.shared.broker.callbacks import (
    DEFAULT_CALLBACK_QUEUE,
    MAX_CALLBACK_BYTES,
    MAX_CALLBACKS,
    Callback,
    CallbackRefusedError,
    Reply,
    owed,
    read_reply,
)
from corral.shared.broker.envelope import Limits, MalformedMessageError, parse_redis_entry
from corral.shared.broker.results import (
    FAILURE,
    SUCCESS,
    ItemCancelledError,
    ItemDispatchError,
    ItemFailedError,
    celery_result,
)
from corral.shared.text import storable_line


def sig(task: str = "upstream.done", **fields: Any) -> dict[str, Any]:
    """A signature as Celery's JSON writes it."""
    return {
        "task": task,
        "args": [1],
        "kwargs": {"k": "v"},
        "options": {},
        "subtask_type": None,
        "immutable": False,
    } | fields


def test_a_plain_signature_is_read_with_its_queue_and_arguments() -> None:
    reply = read_reply(
        "t-1",
        [sig(options={"queue": "mine"})],
        [sig("upstream.err", immutable=True)],
        allowed=("mine", DEFAULT_CALLBACK_QUEUE),
    )
    assert reply == Reply(
        "t-1",
        link=(Callback("upstream.done", (1,), {"k": "v"}, "mine"),),
        link_error=(Callback("upstream.err", (1,), {"k": "v"}, DEFAULT_CALLBACK_QUEUE, True),),
    )
    assert Reply.from_json(json.loads(json.dumps(reply.as_json()))) == reply
    # As Celery calls them: the parent's result first, unless the signature is immutable.
    assert reply.link[0].call_args({"id": "wi-1"}) == [{"id": "wi-1"}, 1]
    assert reply.link_error[0].call_args("t-1") == [1]
    assert read_reply("t-2", None, None) == Reply("t-2")


@pytest.mark.parametrize(
    ("callbacks", "said"),
    [
        ([sig("corral.provision")], "link[0]: a callback may not name corral's or Celery's tasks"),
        ([sig("Corral.Terminate")], "may not name corral's"),
        ([sig("celery.chord_unlock")], "may not name corral's or Celery's"),
        ([sig(options={"queue": "dispatch"})], "may not go to a queue of corral's"),
        ([sig(options={"queue": "maintenance"})], "queue of corral's"),
        ([sig(options={"queue": "provision.local.gpu"})], "queue of corral's"),
        ([sig(options={"queue": "x.celery.pidbox"})], "queue of corral's"),
        ([sig(options={"queue": "celeryev.abc"})], "queue of corral's"),
        ([sig(options={"queue": "a queue"})], "not a queue name"),
        ([sig(options={"countdown": 5})], "the one option corral honours is queue"),
        ([sig(subtask_type="chain")], "only a plain task"),
        ([sig(chord_size=2)], "only a plain task"),
        ([sig(task="not a name")], "task is not a task name"),
        ([sig(task=5)], "task is not a task name"),
        ([sig(args={"a": 1})], "args is a list"),
        ([sig(immutable="yes")], "immutable is true or false"),
        ([sig(extra=1)], "not a task signature"),
        (["upstream.done"], "not a task signature"),
        ({"task": "x"}, "link: a list of task signatures"),
        ([sig()] * (MAX_CALLBACKS + 1), f"at most {MAX_CALLBACKS}"),
        ([sig(args=["x" * MAX_CALLBACK_BYTES])], f"over {MAX_CALLBACK_BYTES} bytes"),
    ],
)
def test_a_callback_corral_may_not_send_is_refused_naming_it(callbacks: Any, said: str) -> None:
    with pytest.raises(CallbackRefusedError, match="link") as refused:
        read_reply("t-1", callbacks, None)
    assert said in refused.value.message
    assert "x" * 100 not in refused.value.message  # no value echoed


def test_a_message_is_owed_its_result_even_when_its_callbacks_are_refused() -> None:
    reply, refused = owed("t-1", [sig("corral.provision")], [sig()])
    assert reply == Reply("t-1") and refused is not None and refused.startswith("link[0]")
    assert owed("t-1", None, [sig("celery.backend_cleanup")])[1] is not None
    # A task id no row or key can hold is owed nothing.
    for unkept in ("", "a\x00b", "a\nb", "\ud800", "x" * 256, 5, None):
        assert owed(unkept, [sig()], None) == (None, None)


def test_a_task_id_is_a_key_as_it_is_or_by_its_digest() -> None:
    task_id = str(uuid.uuid4())
    assert task_key(task_id) == f"celery:{task_id}"
    assert task_key("") is None and task_key(None) is None
    digests = {task_key(weird) for weird in ("a\x00b", "a\nb", "\ud800", "x" * 249, "x" * 250)}
    assert len(digests) == 5
    assert all(key and key.startswith("celery:sha256:") and len(key) == 78 for key in digests)
    assert storable_line("x" * 255) and not storable_line("x" * 256)


@pytest.mark.parametrize(
    ("state", "kind"),
    [
        ("failed", ItemFailedError),
        ("cancelled", ItemCancelledError),
        ("dispatch_error", ItemDispatchError),
    ],
)
def test_an_item_that_did_not_succeed_is_a_failure_carrying_its_record(
    state: str, kind: type[Exception]
) -> None:
    record = {"id": "wi-1", "state": state, "error": {"code": "c", "message": "m"}}
    result_state, value = celery_result(record)
    assert result_state == FAILURE and type(value) is kind
    assert value.args == (record,)  # what Celery stores, and rebuilds the exception from
    assert str(value) == f"work item wi-1 {state}: c: m"


def test_a_succeeded_item_is_a_success_whose_result_is_its_record() -> None:
    record = {"id": "wi-1", "state": "succeeded", "result": {"x": 1}}
    assert celery_result(record) == (SUCCESS, record)
    with pytest.raises(ValueError, match="running"):
        celery_result({"state": "running"})


def _kombu_entry(body: bytes, headers: dict[str, Any]) -> bytes:
    entry = {
        "body": base64.b64encode(body).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": {"body_encoding": "base64", "delivery_tag": "t"},
    }
    return json.dumps(entry).encode()


def test_a_message_too_large_to_read_still_names_its_task_and_callbacks() -> None:
    embed = {"callbacks": [sig()], "errbacks": [sig("upstream.err")], "chain": None, "chord": None}
    body = json.dumps([[{"env": {"BIG": "x" * 20_000}}], {}, embed]).encode()
    headers = {"task": "corral.dispatch", "id": "t-big"}
    with pytest.raises(MalformedMessageError) as too_large:
        parse_redis_entry(_kombu_entry(body, headers), Limits(raw_bytes=10_000))
    refused = too_large.value
    assert (refused.reason, refused.task_name, refused.task_id) == ("too_large", *headers.values())
    assert (refused.callbacks, refused.errbacks) == ([sig()], [sig("upstream.err")])
    assert "x" * 100 not in refused.message


@pytest.mark.parametrize(
    "entry",
    [
        b"x" * 20_000,  # no kombu entry at all
        b'{"body": "' + b"A" * 20_000 + b'", "headers": [1]}',  # headers not an object
        b'{"body": "' + b"A\\u0041" * 3_000 + b'", "headers": {"task": "corral.dispatch"}}',
        b'{"headers": {"task": "corral.dispatch", "id": "t"}, "body": "' + b"A" * 20_000 + b'"}',
    ],
)
def test_a_message_too_large_of_another_shape_names_nothing(entry: bytes) -> None:
    with pytest.raises(MalformedMessageError) as too_large:
        parse_redis_entry(entry, Limits(raw_bytes=10_000))
    assert too_large.value.reason == "too_large"
    assert too_large.value.task_name is None and too_large.value.callbacks is None


def test_a_compressed_body_too_large_names_its_task_but_no_callbacks() -> None:
    body = json.dumps([[{"w": "x" * 20_000}], {}, {"callbacks": [sig()]}]).encode()
    headers = {"task": "corral.dispatch", "id": "t-z", "compression": "application/x-gzip"}
    with pytest.raises(MalformedMessageError) as too_large:
        parse_redis_entry(_kombu_entry(body, headers), Limits(raw_bytes=10_000))
    assert too_large.value.task_id == "t-z" and too_large.value.callbacks is None


def test_a_callback_goes_only_to_a_queue_the_deployment_allows() -> None:
    """A sender names another system's queue on the shared broker: refused, naming the
    setting; a queue the globs allow, and the default queue when allowed, are kept."""
    allowed = ("upstream.*", DEFAULT_CALLBACK_QUEUE)
    with pytest.raises(CallbackRefusedError, match="CORRAL_CALLBACK_QUEUES") as refused:
        read_reply("t-1", [sig(options={"queue": "billing-workers"})], None, allowed=allowed)
    assert "billing-workers" not in refused.value.message
    with pytest.raises(CallbackRefusedError, match="CORRAL_CALLBACK_QUEUES"):
        read_reply("t-1", None, [sig()], allowed=("upstream.*",))  # its default: celery
    with pytest.raises(CallbackRefusedError, match="sends no callbacks"):
        read_reply("t-1", [sig()], None, allowed=())
    reply = read_reply("t-1", [sig(options={"queue": "upstream.done"})], [sig()], allowed=allowed)
    assert [c.queue for c in (*reply.link, *reply.link_error)] == ["upstream.done", "celery"]
    # Even an allow-all pattern never opens corral's own queues.
    with pytest.raises(CallbackRefusedError, match="queue of corral's"):
        read_reply("t-1", [sig(options={"queue": "provision.local"})], None, allowed=("*",))
