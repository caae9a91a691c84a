"""Where the scheduler's intake takes its messages from: the contract.

An inbox hands out the messages waiting on the ``dispatch`` queue in batches and forgets a
message only when it is acknowledged, which the intake does after the message's work item
is committed and its provision task published. A message that was handed out but never
acknowledged (the process died, or the intake released it) is delivered again; the intake
makes that harmless (idempotency keys, and the Celery task id for messages without one).

Implementations: :mod:`corral.scheduler.inbox_redis` (a reliable queue on Redis lists: nothing is
lost between the pop and the commit) and :mod:`corral.scheduler.inbox_kombu` (RabbitMQ and the
in-process ``memory://`` broker, through kombu with manual acknowledgements).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from corral.shared.broker.envelope import Envelope


@dataclass(eq=False)
class Delivery:
    """One message handed out by an inbox.

    ``read`` gives its :class:`~corral.shared.broker.envelope.Envelope`, raising
    :class:`~corral.shared.broker.envelope.MalformedMessageError` when the transport's framing is
    broken;
    ``raw`` is the message as the transport holds it (for the dead letter's size and digest).
    """

    raw: bytes
    read: Callable[[], Envelope]
    handle: Any = field(default=None, repr=False)  # the inbox's own reference


class Inbox(abc.ABC):
    """A batch source of dispatch messages with explicit acknowledgement."""

    @abc.abstractmethod
    def take(self, limit: int, *, wait_s: float) -> list[Delivery]:
        """Up to ``limit`` waiting messages; waits up to ``wait_s`` for the first one only.

        Raises:
            ConnectionError: the broker cannot be reached (the caller backs off and retries).
        """

    @abc.abstractmethod
    def ack(self, deliveries: Sequence[Delivery]) -> None:
        """Forget ``deliveries``: they are done."""

    @abc.abstractmethod
    def release(self, deliveries: Sequence[Delivery]) -> None:
        """Hand ``deliveries`` back to the queue, first in line, for a later :meth:`take`."""

    def recover(self) -> int:
        """Put back the messages of consumers that died holding them; how many. Optional."""
        return 0

    def stray_messages(self) -> int:
        """Messages waiting where no consumer reads (a sender without the key prefix)."""
        return 0

    @abc.abstractmethod
    def close(self) -> None:
        """Release held messages and connections."""
