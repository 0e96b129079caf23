"""Continuous-batching scheduler for one worker: no prefill/decode phases, just catch-up.

Each step every request gets tokens so that its computed tokens catch up with its known
tokens, within the token budget and the sequence limit; long prompts are thereby chunked.
A long prefill's chunks are also cut to the time the step gives them (`PrefillPacer`), so that
running requests keep decoding and new ones are admitted while a long prompt is computed.
Running requests go first; waiting ones are admitted only if nothing was preempted this step.
The scheduling policy (vLLM's) orders both: with "fcfs" requests wait in arrival order and,
when blocks run out, the most recently admitted running request is preempted (recompute);
with "priority" they wait in (priority, arrival time) order, lower first, and the running
request with the largest (priority, arrival time) is preempted, even one already scheduled in
this step, which gives its tokens back.

Lower KV tiers (services/scheduler/kv_tiers.py): blocks freed by their last request are written
down to the worker's host tier by copies the next plan carries; a waiting request whose prefix
continues in a lower tier, or on another worker, has it loaded back first (kv_loads.py) and is
admitted once the worker reports the load.

Disaggregation (handoff.py): a request placed on a prefill worker (`prefill_only`) is computed
up to its first sampled token, then `hand_off_ready` takes it out, its blocks held until its
decode worker has fetched them; there it waits for the fetch like any prefix load.

Async scheduling: a request that samples in a step gets an output placeholder, so the next
plan can be built before the step's result arrives (the worker feeds in its own sampled
token); `update` fills placeholders with the real tokens and runs the stop checks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from services.scheduler.block_pool import KVBlock
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.kv_loads import (
    BlockSource,
    KVLoads,
    LoadJob,
    RemoteKV,
    find_sources,
    release,
)
from services.scheduler.kv_tiers import LowerTiers
from services.scheduler.prefill_pacer import SMOOTHING, PrefillPacer
from services.scheduler.request import FinishReason, Request, RequestStatus
from services.scheduler.request_queue import create_request_queue
from shared.config import SchedulerConfig
from shared.prefix_hash import ROOT_HASH, iter_block_hashes
from shared.wire import (
    BatchPlan,
    CachedRequestData,
    KVLoad,
    ModelRunnerOutput,
    NewRequestData,
    TokenLogprobs,
    WorkerStats,
)

DEFAULT_KV_LOAD_BPS = 1e9  # load bandwidth assumed until a load was measured, bytes/s
MIN_LOAD_WINDOW_S = 0.02  # a plan's loads may take this long at least, beyond the first
# Prefix loads of a request between two admissions: past it (its loaded blocks were evicted
# before it was admitted, or a load failed) it computes its prefix.
MAX_PREFIX_LOADS = 2


@dataclass
class RequestOutput:
    """What one step produced for one request, for the API layer."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None  # why it failed (finish reason ERROR), for its client


class Scheduler:
    """`timed_steps`: the worker reports each step's time (a served worker does; the offline
    engine does not), so a long prefill's first chunk, before any step was timed, is cut to the
    long-prefill threshold instead of taking the whole budget. `tiers`: the worker's lower KV
    tiers, whose blocks are `kv_block_bytes` each; `remote` (set by the worker pool): the
    blocks the other workers hold."""

    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        eos_token_ids: tuple[int, ...] = (),
        *,
        timed_steps: bool = False,
        tiers: LowerTiers | None = None,
        kv_block_bytes: int = 0,
    ) -> None:
        self.config = config
        self.timed_steps = timed_steps
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = min(config.max_model_len, num_blocks * config.block_size)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, tiers)
        self.kv_block_bytes = kv_block_bytes
        self.remote: RemoteKV | None = None
        self.loads = KVLoads()
        self.kv_load_bps = DEFAULT_KV_LOAD_BPS  # measured from the worker's loads
        self.last_result_step = -1  # the latest step whose result came back
        self.tier_hits: dict[str, int] = {}  # prompt tokens loaded, by origin
        self.num_tier_blocks_lost = 0
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.scheduling_policy)
        self.num_waiting_tokens = 0  # tokens of the waiting requests, as counted when queued
        self._queued_tokens: dict[str, int] = {}
        self.running: list[Request] = []
        self.finished_req_ids: list[str] = []  # to tell the worker in the next plan
        self.num_preemptions = 0
        self.pacer = PrefillPacer(config)
        # vLLM's default when prefills are paced: 4% of the context length
        self.long_prefill_threshold = config.long_prefill_token_threshold or max(
            1, self.max_model_len // 25
        )
        self._long_prefill_s: float | None = None  # seconds left to this step's long prefills
        # LoRA adapters admitted here, least recently first, at most max_loras: those the
        # worker most likely holds in its adapter slots
        self.resident_loras: OrderedDict[str, None] = OrderedDict()
        self._prefill_only: set[str] = set()  # requests to hand off once they sampled
        self.handed_off: dict[str, Request] = {}  # their blocks held until released

    @property
    def step_id(self) -> int:
        """The id of the next plan: blocks cached or written down now are ready with it."""
        return self.kv.step_id

    @step_id.setter
    def step_id(self, step_id: int) -> None:
        self.kv.step_id = step_id

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.req_id in self.requests:
            raise ValueError(f"duplicate request id {request.req_id!r}")
        if request.lora is not None and not self.config.max_loras:
            raise ValueError(f"request {request.req_id} needs LoRA; this worker has none")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request.req_id} has {request.num_tokens} tokens; "
                f"the limit is {self.max_model_len - 1}"
            )
        self.requests[request.req_id] = request
        if request.prefill_only:
            self._prefill_only.add(request.req_id)
        self._enqueue(request)

    def abort(self, req_ids: list[str]) -> list[Request]:
        aborted: list[Request] = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is not None:
                self._finish(request, FinishReason.ABORT)
                aborted.append(request)
        return aborted

    def hand_off_ready(self) -> list[Request]:
        """Take out the prefill-only requests that have their first token and nothing in
        flight, for a decode worker; their blocks stay held until `release_handed_off`."""
        ready: list[Request] = []
        for req_id in list(self._prefill_only):
            request = self.requests[req_id]
            if not request.num_output_tokens or request.num_output_placeholders:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.PREEMPTED:
                self.waiting.remove(request)
                self._dequeue(request)
            else:
                continue  # its prefix is being loaded
            self.finished_req_ids.append(req_id)  # the worker drops its state
            self._prefill_only.discard(req_id)
            self.pacer.forget(req_id)
            del self.requests[req_id]
            request.status = RequestStatus.FINISHED
            self.handed_off[req_id] = request
            ready.append(request)
        return ready

    def release_handed_off(self, req_id: str) -> None:
        """Free the blocks of a handed-off request (fetched, or no longer needed)."""
        request = self.handed_off.pop(req_id, None)
        if request is not None:
            self.kv.forget(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loads)

    def unfinished_requests(self) -> list[Request]:
        return [*self.running, *self.waiting, *self.loads.requests()]

    @property
    def max_plans_in_flight(self) -> int:
        """Plans that may await their results at once: two with async scheduling (the
        placeholders look one step ahead), else one."""
        return 2 if self.config.async_scheduling else 1

    # ---- queries -----------------------------------------------------------------------

    @property
    def num_used_blocks(self) -> int:
        return self.kv.num_blocks - self.kv.num_free_blocks

    def num_uncached_blocks(self, token_ids: list[int], root: bytes = ROOT_HASH) -> int:
        """Full blocks of `token_ids` (a sequence whose first block's parent hash is `root`),
        in this worker's block size, not in the prefix cache of any of its tiers."""
        num_full = len(token_ids) // self.kv.block_size
        if not self.kv.tiers.enabled:
            return num_full - self.kv.num_cached_prefix_blocks(token_ids, root)
        pool, tiers, num_hits = self.kv.pool, self.kv.tiers, 0
        for block_hash in iter_block_hashes(token_ids, self.kv.block_size, parent_hash=root):
            if pool.get_cached_block(block_hash) is None and tiers.lookup(block_hash) is None:
                break
            num_hits += 1
        return num_full - num_hits

    def make_stats(self) -> WorkerStats:
        """A snapshot of this worker's load, blocks and cumulative counters."""
        tiers = self.kv.tiers
        return WorkerStats(
            num_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.num_free_blocks,
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.loads),
            num_preemptions=self.num_preemptions,
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            kv_tier_hits=dict(self.tier_hits),
            kv_tier_blocks={t.tier: t.num_slots for t in (tiers.host, tiers.disk)},
            kv_tier_used_blocks={t.tier: len(t) for t in (tiers.host, tiers.disk)},
            kv_tier_blocks_lost=self.num_tier_blocks_lost,
        )

    def request_statuses(self) -> dict[str, str]:
        """Status of every unfinished request (finished ones are dropped at once)."""
        return {req_id: r.status.value for req_id, r in self.requests.items()}

    # ---- one step ----------------------------------------------------------------------

    def schedule(self) -> BatchPlan:
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: list[Request] = []
        kv_loads: list[KVLoad] = []
        self._long_prefill_s = None
        budget = self._schedule_running(
            self.config.max_num_batched_tokens, num_scheduled, cached_reqs, preempted
        )
        if not preempted:
            budget = self._admit_waiting(budget, num_scheduled, new_reqs, cached_reqs, kv_loads)

        plan = BatchPlan(
            step_id=self.step_id,
            new_reqs=new_reqs,
            cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=[r.req_id for r in preempted],
            kv_copies=self.kv.tiers.take_copies(),
            kv_loads=kv_loads,
        )
        self.finished_req_ids = []
        self.pacer.record(
            plan.step_id,
            {
                req_id: (n, self.requests[req_id].num_computed_tokens - n)
                for req_id, n in num_scheduled.items()
                if n > 1
            },
            sum(1 for n in num_scheduled.values() if n == 1),
        )
        self.step_id += 1
        return plan

    def _schedule_running(
        self,
        budget: int,
        num_scheduled: dict[str, int],
        cached_reqs: list[CachedRequestData],
        preempted: list[Request],
    ) -> int:
        """Give the running requests their tokens, in order, preempting when blocks run out;
        returns the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(self._num_runnable_tokens(request), budget)
            num_new = self._pace(request, num_new, num_scheduled)
            if num_new <= 0:
                i += 1
                continue
            new_block_ids = self.kv.allocate_slots(request, num_new)
            while new_block_ids is None:
                j = self._victim_index()
                victim = self.running.pop(j)
                if j < i:  # scheduled earlier in this step: it gives its tokens back
                    i -= 1
                    budget += self._unschedule(victim, num_scheduled, cached_reqs)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                new_block_ids = self.kv.allocate_slots(request, num_new)
            if new_block_ids is None:
                break  # the request preempted itself
            cached_reqs.append(
                CachedRequestData(
                    req_id=request.req_id,
                    new_block_ids=new_block_ids,
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
            num_scheduled[request.req_id] = num_new
            self._advance(request, num_new)
            budget -= num_new
            i += 1
        return budget

    def _pace(self, request: Request, num_new: int, num_scheduled: dict[str, int]) -> int:
        """`num_new` tokens of a request, a long prefill's cut to the seconds this step has
        left for long prefills (`num_scheduled`: the step's tokens so far)."""
        if num_new <= 1 or request.num_tokens <= self.long_prefill_threshold:
            return num_new
        if self._long_prefill_s is None:
            decoding = 1 in num_scheduled.values() or any(
                r.req_id not in num_scheduled and self._num_runnable_tokens(r) == 1
                for r in self.running
            )
            self._long_prefill_s = self.pacer.step_budget(decoding)
        rate = self.pacer.rate(request.req_id)
        if rate <= 0.0 and self.timed_steps and self.pacer.enabled:
            # no prefill of this worker timed yet: one chunk of the threshold, to be measured
            num_new = min(num_new, self.long_prefill_threshold) if self._long_prefill_s else 0
            self._long_prefill_s = 0.0
            return num_new
        num_new = self.pacer.chunk(num_new, rate, self._long_prefill_s)
        self._long_prefill_s -= num_new * rate
        return num_new

    @staticmethod
    def _advance(request: Request, num_new: int) -> None:
        """Count a request's scheduled tokens as computed; one that reaches the end of its
        tokens samples, so its next token is a placeholder until the result comes."""
        request.num_computed_tokens += num_new
        if request.num_computed_tokens >= request.num_tokens_with_placeholders:
            request.num_output_placeholders += 1

    def _num_runnable_tokens(self, request: Request) -> int:
        """Tokens a running request can compute now: those known or sampled by a plan in
        flight, and not computed yet; none once its tokens in flight reach max_tokens."""
        max_tokens = request.sampling_params.max_tokens
        num_outputs = request.num_output_tokens + request.num_output_placeholders
        if max_tokens is not None and num_outputs >= max_tokens:
            return 0
        if request.prefill_only and num_outputs:
            return 0  # it decodes on another worker
        return min(
            request.num_tokens_with_placeholders - request.num_computed_tokens,
            self.max_model_len - 1 - request.num_computed_tokens,
        )

    def _victim_index(self) -> int:
        """Index in `running` of the request to preempt: the latest admitted ("fcfs"), or the
        one with the largest (priority, arrival time), the latest admitted among equals
        ("priority")."""
        last = len(self.running) - 1
        if self.config.scheduling_policy != "priority":
            return last
        running = self.running
        return max(
            range(last, -1, -1), key=lambda j: (running[j].priority, running[j].arrival_time)
        )

    def _unschedule(
        self,
        victim: Request,
        num_scheduled: dict[str, int],
        cached_reqs: list[CachedRequestData],
    ) -> int:
        """Take a running request out of the plan being built, before it is preempted; returns
        the tokens it had been given. The blocks it had in the prefix cache for those tokens
        leave the cache: their KV will not be computed."""
        num_new = num_scheduled.pop(victim.req_id, 0)
        if num_new:
            cached_reqs[:] = [c for c in cached_reqs if c.req_id != victim.req_id]
            self.kv.uncache_from(victim, victim.num_computed_tokens - num_new)
        return num_new

    def _admit_waiting(
        self,
        budget: int,
        num_scheduled: dict[str, int],
        new_reqs: list[NewRequestData],
        cached_reqs: list[CachedRequestData],
        kv_loads: list[KVLoad],
    ) -> int:
        skipped: list[Request] = []  # waiting for one of the step's adapters to finish
        active_loras = {r.lora_name for r in self.running if r.lora is not None}
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if not self._lora_fits(request, active_loras):
                skipped.append(self.waiting.pop())
                continue
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            loading = self._load_prefix(request, hits, kv_loads)
            if loading:
                continue
            if loading is not None:
                break  # no time for its loads in this step
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            num_new = self._pace(request, num_new, num_scheduled)
            if num_new <= 0:
                break  # a long prefill waits for a step with time for it
            new_block_ids = self.kv.allocate_slots(request, num_new, hits)
            if new_block_ids is None:
                break
            self._dequeue(self.waiting.pop())
            request.num_computed_tokens = num_hit_tokens
            self._admitted(request, num_hit_tokens)
            if request.status == RequestStatus.PREEMPTED:
                cached_reqs.append(
                    CachedRequestData(
                        req_id=request.req_id,
                        new_block_ids=new_block_ids,
                        num_computed_tokens=num_hit_tokens,
                        resumed=True,
                    )
                )
            else:
                new_reqs.append(self._new_request_data(request, new_block_ids, num_hit_tokens))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._lora_admitted(request, active_loras)
            num_scheduled[request.req_id] = num_new
            self._advance(request, num_new)
            budget -= num_new
        for request in reversed(skipped):  # back in their places
            self.waiting.prepend(request)
        return budget

    @staticmethod
    def _new_request_data(
        request: Request, block_ids: list[int], num_computed_tokens: int
    ) -> NewRequestData:
        """The request in full, for a worker that does not hold it."""
        return NewRequestData(
            req_id=request.req_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),  # a snapshot
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=num_computed_tokens,
            lora=request.lora,
        )

    def _lora_fits(self, request: Request, active_loras: set[str | None]) -> bool:
        """Whether the request's adapter (if any) is among the step's `active_loras` or
        one more fits the worker's slots."""
        name = request.lora_name
        return name is None or name in active_loras or len(active_loras) < self.config.max_loras

    def _lora_admitted(self, request: Request, active_loras: set[str | None]) -> None:
        """Count an admitted request's adapter as active and as resident (most recent)."""
        name = request.lora_name
        if name is None:
            return
        active_loras.add(name)
        self.resident_loras[name] = None
        self.resident_loras.move_to_end(name)
        while len(self.resident_loras) > self.config.max_loras:
            self.resident_loras.popitem(last=False)

    def _admitted(self, request: Request, num_hit_tokens: int) -> None:
        """Count the prefix lookup of a request admitted with `num_hit_tokens` cached, or land
        its hand-over; its loads since the last admission are done with."""
        if request.handoff is not None:  # its lookup was counted on its prefill worker
            num_blocks = request.num_loaded_tokens // self.kv.block_size
            request.handoff.land(num_blocks * self.kv_block_bytes)
            request.handoff = None  # from now on it is a request of this worker
        elif request.sampling_params.prompt_logprobs is None:  # those never look up
            # its loaded blocks count as lower-tier hits (tier_hits), not device ones
            device_hits = max(num_hit_tokens - request.num_loaded_tokens, 0)
            self.kv.record_lookup(request.num_tokens, device_hits)
        request.num_prefix_loads = request.num_loaded_tokens = 0
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens

    def _load_prefix(
        self, request: Request, hits: list[KVBlock], kv_loads: list[KVLoad]
    ) -> bool | None:
        """Start loading the part of the request's prefix after its device hits `hits` that
        lower tiers hold, as much of it as free blocks can take: True when its loads join this
        plan (it leaves the queue until they are reported), False when they do not fit in this
        step's load window, None when there is nothing to load."""
        if not self.kv.tiers.enabled and self.remote is None:
            return None
        if request.num_prefix_loads >= MAX_PREFIX_LOADS:
            return None  # its loads failed, or their blocks were evicted before it ran
        if request.sampling_params.prompt_logprobs is not None:
            return None  # prompt logprobs need the prompt run
        max_blocks = (request.num_tokens - 1) // self.kv.block_size
        hashes = self.kv.block_hashes(request)[len(hits) : max_blocks]
        if not hashes:
            return None
        if request.handoff is not None:
            return self._fetch_handed_off(request, hits, hashes, kv_loads)
        remote = self.remote if self._remote_pays() else None
        sources = find_sources(self.kv.tiers, remote, hashes)
        room = self.kv.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0)
        release(sources[max(room, 0) :])  # load what fits now; the rest is computed
        sources = sources[: max(room, 0)]
        if not sources:
            return None
        num_bytes = len(sources) * self.kv_block_bytes
        planned = sum(len(load.block_ids) for load in kv_loads) * self.kv_block_bytes
        if kv_loads and planned + num_bytes > self._load_window_bytes():
            release(sources)
            return False
        request.num_prefix_loads += 1
        self._start_load(request, hits, sources, kv_loads)
        return True

    def _fetch_handed_off(
        self, request: Request, hits: list[KVBlock], hashes: list[bytes], kv_loads: list[KVLoad]
    ) -> bool | None:
        """`_load_prefix` of a request handed over by a prefill worker: its prompt blocks
        (`hashes`, after its device hits `hits`) fetched in chunks of what the load window
        moves in one plan, so that no decode step waits long for them (all at once when
        nothing runs here). It waits until all
        its blocks fit, unless nothing runs here (then what fits is fetched and the rest
        computed); a chunk whose predecessor's blocks were evicted before it counts against
        MAX_PREFIX_LOADS."""
        assert request.handoff is not None
        handoff = request.handoff
        if len(hits) <= handoff.num_hits_at_fetch:
            request.num_prefix_loads += 1  # no progress since its last fetch
            if request.num_prefix_loads >= MAX_PREFIX_LOADS:
                return None
        block_size = self.kv.block_size
        room = self.kv.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0)
        needed = -(-request.num_tokens // block_size) - len(hits)
        if room < needed and self.running:
            return False  # it waits for room, as an admission without blocks does
        planned = sum(len(load.block_ids) for load in kv_loads) * self.kv_block_bytes
        window = self._load_window_bytes() - planned
        if kv_loads and window < self.kv_block_bytes:
            return False
        chunk = max(int(window // max(self.kv_block_bytes, 1)), 1)
        if not self.running:
            chunk = len(hashes)  # no step waits for it: all at once
        sources = find_sources(self.kv.tiers, self.remote, hashes[: min(chunk, max(room, 0))])
        if not sources:
            return None
        handoff.num_hits_at_fetch = len(hits)
        self._start_load(request, hits, sources, kv_loads)
        return True

    def _start_load(
        self,
        request: Request,
        hits: list[KVBlock],
        sources: list[BlockSource],
        kv_loads: list[KVLoad],
    ) -> None:
        """Take the request at the head of the queue out of it while `sources` are loaded
        into new blocks after its device hits `hits`; the loads join `kv_loads`."""
        blocks = self.kv.allocate_for_load(request, hits, len(sources))
        assert blocks is not None  # they fit
        self._dequeue(self.waiting.pop())
        job = LoadJob(
            request, sources, set(), request.status == RequestStatus.PREEMPTED, self.step_id
        )
        kv_loads.extend(self.loads.start(job, blocks))
        request.status = RequestStatus.WAITING_FOR_KV

    def _remote_pays(self) -> bool:
        """Whether fetching a block from another worker beats computing it (unknown until a
        prefill was timed: then it is assumed to)."""
        if self.remote is None:
            return False
        token_s = self.pacer.last_token_s
        fetch_s = self.kv_block_bytes / self.kv_load_bps
        return token_s <= 0.0 or fetch_s < token_s * self.kv.block_size

    def _load_window_bytes(self) -> float:
        """The bytes a plan's loads may move beyond the first request's: what the measured
        bandwidth moves in a decode step, so that loads never hold back a step's result."""
        return self.kv_load_bps * max(self.pacer.decode_s, MIN_LOAD_WINDOW_S)

    def _loads_reported(self, output: ModelRunnerOutput) -> None:
        """Send the requests whose loads ended back to the front of the queue: their loaded
        blocks now in the prefix cache, or, after a failed load, to compute their prefix."""
        if output.kv_load_s > 0.0 and output.kv_load_bytes:
            bps = output.kv_load_bytes / output.kv_load_s
            self.kv_load_bps += SMOOTHING * (bps - self.kv_load_bps)
        ended = self.loads.reported(output.kv_loads_done, output.kv_loads_failed)
        for job in reversed(ended):  # each goes to the front: the first ends up first
            request = job.request
            request.status = RequestStatus.PREEMPTED if job.was_preempted else RequestStatus.WAITING
            if job.failed:
                request.num_prefix_loads = MAX_PREFIX_LOADS
            else:
                self.kv.commit_loaded(request, job.plan_step)
                request.num_loaded_tokens += len(job.sources) * self.kv.block_size
                # a hand-over's fetch is counted as such (handoff.py), not as a prefix hit
                for source in job.sources if request.handoff is None else ():
                    self.tier_hits[source.origin] = (
                        self.tier_hits.get(source.origin, 0) + self.kv.block_size
                    )
            # Its blocks wait in the prefix cache, not held: admission finds them there, and
            # requests waiting with blocks could otherwise hold the pool with none running.
            self.kv.free(request)
            self._enqueue(request, preempted=True)
        for tier, slots in output.kv_lost.items():
            self.num_tier_blocks_lost += self.kv.tiers.lost(tier, slots)

    def _enqueue(self, request: Request, preempted: bool = False) -> None:
        if preempted:
            self.waiting.prepend(request)
        else:
            self.waiting.add(request)
        self._queued_tokens[request.req_id] = request.num_tokens
        self.num_waiting_tokens += request.num_tokens

    def _dequeue(self, request: Request) -> None:
        """Uncount a request that left `waiting`."""
        self.num_waiting_tokens -= self._queued_tokens.pop(request.req_id)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token still in flight is appended on arrival
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, preempted=True)

    # ---- results -----------------------------------------------------------------------

    def update(self, output: ModelRunnerOutput) -> list[RequestOutput]:
        """Append sampled tokens, run stop checks, free finished requests.

        A request that finished (or was aborted) after this step was planned is gone: its
        token from this step is dropped. One preempted after it was planned keeps its token.
        """
        self.pacer.observe(output)
        self.last_result_step = max(self.last_result_step, output.step_id)
        if output.kv_loads_done or output.kv_loads_failed or output.kv_lost:
            self._loads_reported(output)
        outputs: list[RequestOutput] = []
        for req_id, error in output.failed_reqs.items():  # they left the worker's batch
            request = self.requests.get(req_id)
            if request is not None:
                self._finish(request, FinishReason.ERROR)
                outputs.append(RequestOutput(req_id, [], FinishReason.ERROR, error=error))
        requests, logprobs = self.requests, output.logprobs
        prompt_logprobs_of = output.prompt_logprobs
        for i, req_id in enumerate(output.req_ids):
            request = requests.get(req_id)
            if request is None:
                continue  # finished or aborted while the step ran
            token_ids = output.sampled_token_ids[i]
            prompt_logprobs = prompt_logprobs_of.get(req_id) if prompt_logprobs_of else None
            if not token_ids and prompt_logprobs is None:
                continue
            new_token_ids: list[int] = []
            for token_id in token_ids:
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                if self._check_stop(request, token_id):
                    break
            outputs.append(
                RequestOutput(
                    req_id,
                    new_token_ids,
                    request.finish_reason,
                    request.stop_token_id,
                    max(request.num_cached_tokens, 0),
                    [logprobs[i]] if logprobs else [],
                    prompt_logprobs,
                )
            )
        return outputs

    def _check_stop(self, request: Request, token_id: int) -> bool:
        params = request.sampling_params
        num_outputs = len(request.output_token_ids)
        if num_outputs >= params.min_tokens:
            if token_id in self.eos_token_ids and not params.ignore_eos:
                self._finish(request, FinishReason.STOP)
                return True
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.stop_token_id = token_id
                self._finish(request, FinishReason.STOP)
                return True
        max_tokens = params.max_tokens
        if (max_tokens is not None and num_outputs >= max_tokens) or len(
            request.all_token_ids
        ) >= self.max_model_len:
            self._finish(request, FinishReason.LENGTH)
            return True
        return False

    def _finish(self, request: Request, reason: FinishReason) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self.finished_req_ids.append(request.req_id)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
            self._dequeue(request)
            if request.status == RequestStatus.PREEMPTED:
                self.finished_req_ids.append(request.req_id)
        elif request.status == RequestStatus.WAITING_FOR_KV:
            job = self.loads.cancel(request.req_id)
            if job is not None and job.was_preempted:
                self.finished_req_ids.append(request.req_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._prefill_only.discard(request.req_id)
        if request.handoff is not None:
            request.handoff.drop()
        self.kv.forget(request)
        self.pacer.forget(request.req_id)
        del self.requests[request.req_id]


def plan_has_work(plan: BatchPlan) -> bool:
    """Whether a plan must reach the worker: tokens to run, request state to drop or KV to
    copy or load."""
    return bool(
        plan.num_scheduled_tokens
        or plan.finished_req_ids
        or plan.preempted_req_ids
        or plan.kv_copies
        or plan.kv_loads
    )
