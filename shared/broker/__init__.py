"""Broker wire code: corral's Celery app and queue table, reading task messages within bounds
(``envelope``, ``task_calls``), the Redis transport and the worker consumer that no message
can stop, and dead letters."""
