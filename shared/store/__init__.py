"""The system of record and the domain written to it: the database and its models and
migrations, every state change (``lifecycle``), slots, leases, tokens, budgets and the
ledger, pools, breakers, warm sandboxes, bundles, sealing, credentials and provider configs."""
