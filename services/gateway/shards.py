"""The gateway's view of the scheduler shards, and the choice of the shard a request goes to.

Shard i is one scheduler and its workers on the subjects of `shard_prefixes(prefix, n)[i]`. The
gateway knows each one from its heartbeats (epoch, ready workers, context length, load) and
from what it has submitted to it since the last one. A shard is *available* while its last
heartbeat is fresh, it has ready workers and it has not announced that it is leaving (a
scheduler that shuts down says so in its last heartbeat). `wait_for_change` lets a request that
found no available shard wait for the next heartbeat instead of failing at once.

Routing (`Shards.route`), by load: a new request goes to the available shard with the fewest
requests per ready worker. By prefix (the default): each heartbeat also carries the shard's KV
block size and a summary of the blocks its workers hold (`shared.prefix_summary`); the request
goes to the shard holding the longest prefix of its tokens' block-hash chain, the least loaded
of those on a tie, unless that shard's load exceeds the least loaded one's by more than
`max_imbalance`; without a match it goes by load. Multi-turn conversations, which resend a
growing history, so stay where their earlier turns' KV blocks are. A least loaded shard that
holds nothing (just started) also takes the request: else, while the others all hold a shared
system prompt, it would get no new conversation until they were `max_imbalance` busier.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from shared.prefix_hash import iter_block_hashes, prefix_root
from shared.prefix_summary import PrefixSummary
from shared.subjects import Subjects, shard_prefixes
from shared.wire import SchedulerHeartbeat

logger = logging.getLogger(__name__)

RoutingReason = Literal["prefix", "load"]
ROUTINGS: tuple[RoutingReason, ...] = ("prefix", "load")  # the routings, and the reasons


class Route(NamedTuple):
    """Where a request goes, why, and how many of its leading tokens that shard holds (as
    far as its prefix summary tells)."""

    shard: int
    reason: RoutingReason
    num_matched_tokens: int = 0


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
    block_size: int = 0  # of its workers' KV blocks (0: not announced)
    prefix_summary: PrefixSummary = field(default_factory=PrefixSummary)  # the blocks they hold
    lora_adapters: dict[str, str] = field(default_factory=dict)  # name -> directory
    # Requests routed to it by reason, and the prompt tokens its prefix summary matched
    routed: Counter[RoutingReason] = field(default_factory=Counter)
    matched_tokens: int = 0

    def heartbeat(self, beat: SchedulerHeartbeat) -> bool:
        """Take in a heartbeat; True when it announces a new epoch (the scheduler restarted).
        A prefix summary that does not decode counts as empty."""
        restarted = self.epoch is not None and beat.epoch != self.epoch
        self.epoch = beat.epoch
        self.num_ready_workers = beat.num_ready_workers
        self.model = beat.model
        self.max_model_len = beat.max_model_len or None
        self.num_running = beat.num_running
        self.num_waiting = beat.num_waiting
        self.kv_cache_usage = beat.kv_cache_usage
        self.leaving = beat.leaving
        self.block_size = beat.block_size
        self.lora_adapters = beat.lora_adapters
        try:
            self.prefix_summary = PrefixSummary(beat.prefix_summary)
        except ValueError as e:
            logger.warning("ignoring the prefix summary of %s: %s", self.subjects.prefix, e)
            self.prefix_summary = PrefixSummary()
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
    """Every shard's state, by index, and the routing of requests over them."""

    def __init__(
        self,
        prefix: str,
        num_shards: int,
        heartbeat_timeout: float,
        routing: str = "prefix",
        max_imbalance: float = 4.0,
    ) -> None:
        """`routing`: "prefix" or "load"; `max_imbalance`: how many requests per ready worker
        the shard holding the longest prefix may have beyond the least loaded one."""
        if routing not in ROUTINGS:
            raise ValueError(f"shard routing must be prefix or load, got {routing!r}")
        self.heartbeat_timeout = heartbeat_timeout
        self.routing = routing
        self.max_imbalance = max_imbalance
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

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters the available shards serve (name -> directory), the union."""
        adapters: dict[str, str] = {}
        for shard in self._states:
            if self.available(shard):
                adapters.update(shard.lora_adapters)
        return adapters

    def choose(
        self,
        exclude: Collection[int] = (),
        token_ids: list[int] | None = None,
        lora_name: str | None = None,
    ) -> int | None:
        """The index of the available shard not in `exclude` that a request of `token_ids`
        (and adapter `lora_name`) goes to (`route`), if any."""
        route = self.route(exclude, token_ids, lora_name)
        return None if route is None else route.shard

    def route(
        self,
        exclude: Collection[int] = (),
        token_ids: list[int] | None = None,
        lora_name: str | None = None,
    ) -> Route | None:
        """Where a request of `token_ids` goes among the available shards not in `exclude`:
        by prefix, to the one whose summary holds the longest prefix of its block-hash chain
        (the least loaded of those), unless it has more than `max_imbalance` requests per
        ready worker beyond the least loaded shard or that one holds nothing; otherwise to the
        least loaded shard (the lowest index on a tie). A request of the LoRA adapter
        `lora_name` goes only to shards serving it, and its chain starts at the adapter's
        root. None when no shard is available."""
        candidates = [
            (s.load, i)
            for i, s in enumerate(self._states)
            if i not in exclude
            and self.available(s)
            and (lora_name is None or lora_name in s.lora_adapters)
        ]
        if not candidates:
            return None
        least_load, least = min(candidates)
        if self.routing != "prefix" or not token_ids:
            return Route(least, "load")
        chains: dict[int, list[bytes]] = {}  # the prompt's block hashes, by block size
        matched: dict[int, int] = {}  # tokens each shard's summary holds, by index
        for _, i in candidates:
            shard = self._states[i]
            if shard.block_size > 0 and shard.prefix_summary:
                chain = chains.get(shard.block_size)
                if chain is None:
                    chain = list(
                        iter_block_hashes(
                            token_ids, shard.block_size, parent_hash=prefix_root(lora_name)
                        )
                    )
                    chains[shard.block_size] = chain
                matched[i] = shard.prefix_summary.longest_prefix(chain) * shard.block_size
        _, load, best = min((-matched.get(i, 0), load, i) for load, i in candidates)
        cold = not self._states[least].prefix_summary  # it warms up by load
        if not matched.get(best) or cold or load - least_load > self.max_imbalance:
            return Route(least, "load", matched.get(least, 0))
        return Route(best, "prefix", matched[best])

    def count(self, route: Route) -> None:
        """Count a request routed: by shard and reason, and the tokens matched."""
        shard = self._states[route.shard]
        shard.routed[route.reason] += 1
        shard.matched_tokens += route.num_matched_tokens
