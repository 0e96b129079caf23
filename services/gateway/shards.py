"""The gateway's view of the scheduler shards, and the choice of the shard a request goes to.

Shard i is one scheduler and its workers on the subjects of `shard_prefixes(prefix, n)[i]`. The
gateway knows each one from its heartbeats (epoch, ready workers, context length, load) and
from what it has submitted to it since the last one. A shard is *available* while its last
heartbeat is fresh, it has ready workers and it has not announced that it is leaving (a
scheduler that shuts down says so in its last heartbeat); a new request goes to the available
shard with the fewest requests per ready worker. `wait_for_change` lets a request that found no
available shard wait for the next heartbeat instead of failing at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from shared.subjects import Subjects, shard_prefixes
from shared.wire import SchedulerHeartbeat


@dataclass
class ShardState:
    """One shard's subjects and its last heartbeat."""

    subjects: Subjects
    epoch: str | None = None
    num_ready_workers: int = 0
    model: str = ""
    max_model_len: int | None = None
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    leaving: bool = False  # the scheduler said its last heartbeat is this one
    last_heartbeat: float = float("-inf")  # time.monotonic()
    submitted: int = 0  # requests this gateway submitted to it since its last heartbeat

    def heartbeat(self, beat: SchedulerHeartbeat) -> bool:
        """Take in a heartbeat; True when it announces a new epoch (the scheduler restarted)."""
        restarted = self.epoch is not None and beat.epoch != self.epoch
        self.epoch = beat.epoch
        self.num_ready_workers = beat.num_ready_workers
        self.model = beat.model
        self.max_model_len = beat.max_model_len or None
        self.num_running = beat.num_running
        self.num_waiting = beat.num_waiting
        self.kv_cache_usage = beat.kv_cache_usage
        self.leaving = beat.leaving
        self.last_heartbeat = time.monotonic()
        self.submitted = 0
        return restarted

    @property
    def heartbeat_age(self) -> float:
        """Seconds since the last heartbeat (infinite before the first)."""
        return time.monotonic() - self.last_heartbeat

    @property
    def load(self) -> float:
        """Requests per ready worker: running and waiting at the last heartbeat, plus ours since."""
        queued = self.num_running + self.num_waiting + self.submitted
        return queued / max(self.num_ready_workers, 1)


class Shards:
    """Every shard's state, by index."""

    def __init__(self, prefix: str, num_shards: int, heartbeat_timeout: float) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self._states = [ShardState(Subjects(p)) for p in shard_prefixes(prefix, num_shards)]
        self._changed: asyncio.Event | None = None  # set (and replaced) on every heartbeat

    def heartbeat(self, index: int, beat: SchedulerHeartbeat) -> bool:
        """Take in shard `index`'s heartbeat (True: a new epoch) and wake the waiters."""
        restarted = self._states[index].heartbeat(beat)
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        return restarted

    async def wait_for_change(self, deadline: float) -> bool:
        """Wait for the next heartbeat of any shard, until `deadline` (time.monotonic());
        False when the deadline passed first."""
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            return False
        if self._changed is None:
            self._changed = asyncio.Event()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def __getitem__(self, index: int) -> ShardState:
        return self._states[index]

    def __iter__(self) -> Iterator[ShardState]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def fresh(self, shard: ShardState) -> bool:
        return shard.heartbeat_age < self.heartbeat_timeout

    def available(self, shard: ShardState) -> bool:
        return self.fresh(shard) and shard.num_ready_workers > 0 and not shard.leaving

    @property
    def ready(self) -> bool:
        return any(self.available(s) for s in self._states)

    @property
    def max_model_len(self) -> int | None:
        """The smallest context length of the fresh shards (of every shard heard from, while
        none is fresh)."""
        known = [s.max_model_len for s in self._states if s.max_model_len is not None]
        fresh = [
            s.max_model_len for s in self._states if s.max_model_len is not None and self.fresh(s)
        ]
        return min(fresh or known, default=None)

    def choose(self, exclude: Collection[int] = ()) -> int | None:
        """The index of the least loaded available shard not in `exclude` (the lowest on a
        tie), if any."""
        candidates = [
            (s.load, i)
            for i, s in enumerate(self._states)
            if i not in exclude and self.available(s)
        ]
        return min(candidates)[1] if candidates else None
