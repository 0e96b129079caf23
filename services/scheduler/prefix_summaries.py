"""The summary of the KV blocks a shard's workers hold, sent in its heartbeat: gateways route
a prompt to the shard that holds its longest prefix (`shared.prefix_summary`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.worker_pool import WorkerPool
from shared.prefix_summary import DEFAULT_MAX_BYTES, build


def summarize(
    kvs: Iterable[KVCacheManager], max_bytes: int = DEFAULT_MAX_BYTES
) -> tuple[int, bytes]:
    """(block size, summary) of the blocks the KV managers `kvs` hold in any tier; (0, b"")
    without any. The workers of a shard share one block size: one with another size than the
    first's is left out (its hashes chain other blocks than a gateway hashes a prompt into)."""
    kvs = list(kvs)
    if not kvs:
        return 0, b""
    block_size = kvs[0].block_size
    hashes = itertools.chain.from_iterable(
        kv.resident_block_hashes() for kv in kvs if kv.block_size == block_size
    )
    return block_size, build(hashes, max_bytes)


def pool_prefix_summary(pool: WorkerPool, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[int, bytes]:
    """(block size, summary) of every worker of the pool, healthy or not."""
    return summarize((w.core.kv for w in pool.workers.values()), max_bytes)
