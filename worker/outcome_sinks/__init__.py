"""Who delivers an ended item's outcomes (corral.shared.store.outbox): one sink per kind of
target. ``base``: the contract; ``celery_result``: a Celery result backend and the message's
callbacks; ``testing``: an in-memory sink that records what it was given."""
