"""The worker's lower KV tiers (a host-memory pool and a local-disk tier) and the executor of
the copies and loads a plan carries between them and the device pool. The scheduler decides
every move; the worker executes them exactly and in order."""
