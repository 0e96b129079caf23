"""The blocks the other workers of a shard hold, as sources a worker can fetch over the
KV-transfer path instead of computing them again.

A worker's scheduling core knows its device pool and lower tiers exactly, so a lookup here
is exact too: a block is offered only once the plan that computed or wrote it was answered
(its `ready_step`), and it stays pinned on its holder until the fetch is reported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from services.scheduler.kv_loads import BlockSource
from services.scheduler.scheduler import Scheduler
from shared.wire import KV_DEVICE, WorkerHello


class FleetKV:
    """`RemoteKV` of one worker, whose blocks are `kv_block_bytes` each: the healthy other
    workers of `peers()`, as (hello, core), with a KV-transfer address and blocks alike."""

    def __init__(
        self,
        worker_id: str,
        kv_block_bytes: int,
        peers: Callable[[], Iterable[tuple[WorkerHello, Scheduler]]],
    ) -> None:
        self.worker_id = worker_id
        self.kv_block_bytes = kv_block_bytes
        self._peers = peers

    def find(self, block_hash: bytes) -> BlockSource | None:
        for hello, core in self._peers():
            if hello.worker_id == self.worker_id or not hello.kv_transfer_address:
                continue
            if hello.kv_block_bytes != self.kv_block_bytes:
                continue
            source = _readable(hello, core, block_hash)
            if source is not None:
                return source
        return None


def _readable(hello: WorkerHello, core: Scheduler, block_hash: bytes) -> BlockSource | None:
    """A pinned source of the block on `core`'s worker, if that worker has it written."""
    address, instance_id = hello.kv_transfer_address, hello.instance_id
    pool = core.kv.pool
    block = pool.get_cached_block(block_hash)
    if block is not None and block.ready_step <= core.last_result_step:
        pool.touch([block])
        return BlockSource(
            KV_DEVICE, block.block_id, functools.partial(pool.free, [block]), address, instance_id
        )
    tiers = core.kv.tiers
    entry = tiers.lookup(block_hash)
    if entry is not None and entry.ready_step <= core.last_result_step:
        index = tiers.tier(tiers.tier_of(entry))
        entry.pins += 1
        return BlockSource(
            index.tier, entry.slot, functools.partial(index.unpin, entry), address, instance_id
        )
    return None
