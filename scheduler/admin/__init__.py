"""What operators do and read, shared by the api, the console and the CLI: pools and
profiles, budgets, providers and credentials, cancelling an item, and how work items,
sandboxes and costs read from the outside (the response models)."""
