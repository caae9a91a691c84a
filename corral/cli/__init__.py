"""The ``corral`` command: its entry point (:mod:`.main`), one module per group of commands,
``corral dev`` and its demo, and what they share (output, following an item, the api's
address)."""
