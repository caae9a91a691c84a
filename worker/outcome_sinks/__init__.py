"""Who delivers an ended item's outcomes (corral.shared.store.outbox): one sink per kind of
target. ``base``: the contract; ``celery_result``: a Celery result backend and the message's
callbacks; ``webhook``: an org's signed events POSTed to its endpoints (``webhook_transport``:
the address-checked POST); ``testing``: an in-memory sink that records what it was given."""
