"""How many messages wait on each queue, asked of the broker (the api's metrics, the
console's overview).

On kombu's virtual transports (Redis, ``memory://``) the channel's own size of the queue:
the sum of its priority lists, under the deployment's key prefix; a list never written holds
none. (kombu's passive declare is no use there: on Redis it looks for the lists without the
key prefix, so with one every queue is "not found".) On RabbitMQ, a passive declare: the
broker's count; a queue it does not know holds none.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from celery import Celery

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0


def queue_depths(
    app: Celery, queues: Iterable[str], *, timeout_s: float = TIMEOUT_S
) -> dict[str, int]:
    """Each queue's waiting messages; the broker is given ``timeout_s`` to connect.

    Raises:
        OSError, kombu's OperationalError: the broker cannot be reached.
    """
    depths: dict[str, int] = {}
    with app.connection_for_read() as connection:
        connection.ensure_connection(max_retries=1, interval_start=0, timeout=timeout_s)
        channel_errors = connection.channel_errors
        for queue in sorted(set(queues)):
            # A channel per queue: on AMQP an unknown queue closes the channel that asked.
            channel = connection.channel()
            try:
                depths[queue] = _waiting(channel, queue)
            except channel_errors:
                depths[queue] = 0
            finally:
                try:
                    channel.close()
                except Exception:  # a channel the broker closed already
                    log.debug("channel already closed", exc_info=True)
    return depths


def _waiting(channel: Any, queue: str) -> int:
    size = getattr(channel, "_size", None)  # kombu's virtual channels
    if size is not None:
        return int(size(queue))
    return int(channel.queue_declare(queue=queue, passive=True).message_count)
