"""corral's Celery app on real Redis."""

from __future__ import annotations

import uuid

import redis

from shared.celery_app import configure
from shared.settings import CoreSettings


def test_reconfiguring_sends_through_the_new_broker_settings(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    first, second = (f"corral-t-{uuid.uuid4().hex[:8]}:" for _ in range(2))
    try:
        configure(CoreSettings(broker_url=redis_url, broker_key_prefix=first)).send_task(
            "corral.redrive"
        )
        configure(CoreSettings(broker_url=redis_url, broker_key_prefix=second)).send_task(
            "corral.redrive"
        )
        assert client.llen(f"{first}maintenance") == 1
        assert client.llen(f"{second}maintenance") == 1
    finally:
        for prefix in (first, second):
            for key in client.scan_iter(f"{prefix}*"):
                client.delete(key)
        client.close()
        configure(CoreSettings(broker_url="memory://"))
