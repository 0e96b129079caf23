"""Prefix blocks loaded back into a worker's device pool from lower tiers, its own or another
worker's.

A waiting request whose prefix continues below the device pool does not compute it again:
admission finds each further block's source (this worker's host or disk tier, else another
worker of the shard), pins it, gives the request device blocks and puts `KVLoad`s in the plan.
The worker runs them alongside that plan's forward pass and reports each load in the plan's
result; the loaded blocks then join the device prefix cache and the request goes back to the
front of the queue, where admission finds them as prefix hits. A failed load (source gone,
checksum mismatch) sends the request back to be computed from its device-cached prefix.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from services.scheduler.block_pool import KVBlock
from services.scheduler.kv_tiers import LowerTiers
from services.scheduler.request import Request
from shared.wire import KVLoad

REMOTE = "remote"  # the origin of a block fetched from another worker


@dataclass
class BlockSource:
    """Where one block missing from the device pool is read from; pinned there until
    `release` is called."""

    tier: str
    index: int  # block id (device) or slot
    release: Callable[[], object]
    address: str = ""  # the KV-transfer address of the worker holding it; "": this worker
    instance_id: str = ""

    @property
    def origin(self) -> str:
        """host or disk (this worker's), or remote."""
        return REMOTE if self.address else self.tier


class RemoteKV(Protocol):
    """The blocks other workers hold."""

    def find(self, block_hash: bytes) -> BlockSource | None:
        """A pinned source of the block on another worker, if one holds it readable."""
        ...


def find_sources(
    tiers: LowerTiers, remote: RemoteKV | None, block_hashes: Iterable[bytes]
) -> list[BlockSource]:
    """Pinned sources of the leading blocks of `block_hashes`, up to the first one found
    nowhere: this worker's lower tiers first, then (`remote` given) the other workers."""
    sources: list[BlockSource] = []
    for block_hash in block_hashes:
        entry = tiers.lookup(block_hash)
        if entry is not None:
            index = tiers.tier(tiers.tier_of(entry))
            index.touch(entry)
            entry.pins += 1
            sources.append(
                BlockSource(index.tier, entry.slot, functools.partial(index.unpin, entry))
            )
            continue
        source = remote.find(block_hash) if remote is not None else None
        if source is None:
            break
        sources.append(source)
    return sources


def release(sources: Iterable[BlockSource]) -> None:
    for source in sources:
        source.release()


@dataclass
class LoadJob:
    """One request's prefix being loaded."""

    request: Request
    sources: list[BlockSource]
    load_ids: set[int]  # not reported yet
    was_preempted: bool  # the worker holds its state from before
    plan_step: int  # the plan that carries the loads
    failed: bool = False


class KVLoads:
    """The requests of one worker whose prefix is being loaded."""

    def __init__(self) -> None:
        self.jobs: dict[str, LoadJob] = {}
        self._job_of: dict[int, LoadJob] = {}  # load_id -> job
        self._load_ids = itertools.count()

    def __len__(self) -> int:
        return len(self.jobs)

    def requests(self) -> list[Request]:
        return [job.request for job in self.jobs.values()]

    def start(self, job: LoadJob, blocks: list[KVBlock]) -> list[KVLoad]:
        """Track `job` and return its loads into `blocks` (one per run of blocks with the same
        source worker and tier)."""
        loads: list[KVLoad] = []
        key = None
        for block, source in zip(blocks, job.sources, strict=True):
            if (source.address, source.tier) != key:
                key = (source.address, source.tier)
                load_id = next(self._load_ids)
                loads.append(
                    KVLoad(
                        load_id=load_id,
                        block_ids=[],
                        src_tier=source.tier,
                        src=[],
                        remote_address=source.address,
                        remote_instance_id=source.instance_id,
                    )
                )
                job.load_ids.add(load_id)
                self._job_of[load_id] = job
            loads[-1].block_ids.append(block.block_id)
            loads[-1].src.append(source.index)
        self.jobs[job.request.req_id] = job
        return loads

    def reported(self, done: list[int], failed: list[int]) -> list[LoadJob]:
        """Take a result's load reports; returns the jobs that ended (`failed` set on those
        with a failed load), their sources released."""
        ended: list[LoadJob] = []
        for load_id, ok in itertools.chain(((i, True) for i in done), ((i, False) for i in failed)):
            job = self._job_of.pop(load_id, None)
            if job is None:
                continue  # of a request finished meanwhile
            job.load_ids.discard(load_id)
            job.failed |= not ok
            if not job.load_ids:
                ended.append(self._end(job))
        return ended

    def cancel(self, req_id: str) -> LoadJob | None:
        """Stop tracking a request's loads (it finished); its sources are released."""
        job = self.jobs.get(req_id)
        if job is None:
            return None
        for load_id in job.load_ids:
            self._job_of.pop(load_id, None)
        return self._end(job)

    def cancel_all(self) -> None:
        for req_id in list(self.jobs):
            self.cancel(req_id)

    def _end(self, job: LoadJob) -> LoadJob:
        del self.jobs[job.request.req_id]
        release(job.sources)
        return job
