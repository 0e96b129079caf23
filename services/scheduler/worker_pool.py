"""The workers a scheduler drives: one scheduling core (block pool included) per worker, and
placement of new requests on the worker where they cost least."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from services.scheduler.kv_cache_manager import chain_hashes
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.protocol import WorkerHello


@dataclass
class WorkerHandle:
    hello: WorkerHello
    core: Scheduler
    session: str = field(default_factory=lambda: uuid.uuid4().hex[:8])  # new core, new session
    last_seen: float = field(default_factory=time.monotonic)

    @property
    def worker_id(self) -> str:
        return self.hello.worker_id


class WorkerPool:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.workers: dict[str, WorkerHandle] = {}

    def register(
        self, hello: WorkerHello, fresh: bool = False
    ) -> tuple[WorkerHandle, WorkerHandle | None]:
        """Add a worker; returns (handle, replaced) where `replaced` is a previous instance of
        the same worker id whose state is gone. `fresh` forces a new core (and session) for a
        known instance whose state can no longer be trusted."""
        old = self.workers.get(hello.worker_id)
        if old is not None and old.hello.instance_id == hello.instance_id and not fresh:
            old.last_seen = time.monotonic()
            return old, None
        config = SchedulerConfig(
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=min(self.config.max_model_len, hello.max_model_len),
            block_size=hello.block_size,
            enable_prefix_caching=self.config.enable_prefix_caching,
        )
        core = Scheduler(config, hello.num_blocks, tuple(hello.eos_token_ids))
        if old is not None:  # step ids keep rising, so a late result of the old core is ignored
            core.step_id = old.core.step_id + 1
        handle = WorkerHandle(hello, core)
        self.workers[hello.worker_id] = handle
        return handle, old

    def remove(self, worker_id: str) -> WorkerHandle | None:
        return self.workers.pop(worker_id, None)

    def expired(self, timeout_s: float) -> list[WorkerHandle]:
        now = time.monotonic()
        return [w for w in self.workers.values() if now - w.last_seen > timeout_s]

    @property
    def max_model_len(self) -> int:
        return min((w.core.max_model_len for w in self.workers.values()), default=0)

    def place(self, request: Request) -> WorkerHandle:
        """Lowest cost = prompt blocks not cached there + blocks in use there."""
        if not self.workers:
            raise LookupError("no worker is ready")
        block_size = next(iter(self.workers.values())).core.config.block_size
        hashes = chain_hashes(request.all_token_ids, block_size)

        def cost(w: WorkerHandle) -> tuple[int, int]:
            pool = w.core.kv.pool
            uncached = len(hashes) - w.core.kv.num_cached_blocks_of(hashes)
            return uncached + (pool.num_blocks - pool.num_free_blocks), len(w.core.running)

        return min(self.workers.values(), key=cost)
