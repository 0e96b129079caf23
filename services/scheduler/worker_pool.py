"""The workers a scheduler drives: one scheduling core (block pool included) per worker, and
the choice of the healthy worker where a new request costs least."""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field

from services.scheduler.fleet_kv import FleetKV
from services.scheduler.kv_tiers import LowerTiers
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.wire import ROLE_PREFILL, WorkerHello, WorkerStats

# What loading a LoRA adapter into a worker's slots costs a request placed there, in tokens
# of KV it would otherwise have to compute or hold: a worker already holding the adapter wins
# unless it is this much busier (a rank-16 adapter of a small model loads in well under a
# second; as many tokens prefill on a CPU in about as long).
LORA_LOAD_COST_TOKENS = 512


@dataclass
class WorkerHandle:
    hello: WorkerHello
    core: Scheduler
    # `BatchPlan.worker_session` of this core's plans: a new core, a new session
    session: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    last_seen: float = field(default_factory=time.monotonic)
    healthy: bool = True  # False from a missed step deadline until it answers a probe
    # The step its heartbeats last reported progress on (-1: none yet), and when (monotonic)
    progress_step_id: int = -1
    progress_at: float = 0.0

    @property
    def worker_id(self) -> str:
        return self.hello.worker_id

    @property
    def role(self) -> str:
        return self.hello.role

    def heard(self, beat: WorkerHello) -> None:
        """A heartbeat of this instance: alive, and if its progress counter went up since the
        last one, progressing on the step it reports (a replayed or stale heartbeat, or one
        of a worker that hangs, does not advance it)."""
        now = time.monotonic()
        self.last_seen = now
        if beat.progress > self.hello.progress and beat.step_id >= 0:
            self.progress_step_id, self.progress_at = beat.step_id, now
        if beat.progress >= self.hello.progress:
            self.hello = beat


class WorkerPool:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.workers: dict[str, WorkerHandle] = {}

    def register(
        self, hello: WorkerHello, fresh: bool = False
    ) -> tuple[WorkerHandle, WorkerHandle | None]:
        """Add a worker; returns (handle, replaced) where `replaced` is a previous instance of
        the same worker id whose state is gone. `fresh` forces a new core (and session) for a
        known instance whose state can no longer be trusted; it stays as healthy as it was.
        A new instance is healthy."""
        old = self.workers.get(hello.worker_id)
        if old is not None and old.hello.instance_id == hello.instance_id and not fresh:
            old.heard(hello)
            return old, None
        config = dataclasses.replace(
            self.config,
            max_num_seqs=min(self.config.max_num_seqs, hello.max_num_seqs),
            max_model_len=min(self.config.max_model_len, hello.max_model_len),
            block_size=hello.block_size,
            max_loras=hello.max_loras,
        )
        if hello.role == ROLE_PREFILL:  # nothing decodes there: long prefills take full steps
            config = dataclasses.replace(config, long_prefill_step_time=0.0, long_prefill_share=1.0)
        core = Scheduler(
            config,
            hello.num_blocks,
            tuple(hello.eos_token_ids),
            timed_steps=True,
            tiers=LowerTiers(hello.num_host_blocks, hello.num_disk_blocks),
            kv_block_bytes=hello.kv_block_bytes,
        )
        if config.enable_prefix_caching:
            core.remote = FleetKV(hello.worker_id, hello.kv_block_bytes, self._peers)
        if old is not None:  # step ids keep rising, so a late result of the old core is ignored
            core.step_id = old.core.step_id + 1
        handle = WorkerHandle(hello, core)
        if old is not None and old.hello.instance_id == hello.instance_id:
            handle.healthy = old.healthy
        self.workers[hello.worker_id] = handle
        return handle, old

    def _peers(self) -> list[tuple[WorkerHello, Scheduler]]:
        """The healthy workers, whose blocks others may fetch."""
        return [(w.hello, w.core) for w in self.workers.values() if w.healthy]

    def remove(self, worker_id: str) -> WorkerHandle | None:
        return self.workers.pop(worker_id, None)

    def expired(self, timeout_s: float) -> list[WorkerHandle]:
        now = time.monotonic()
        return [w for w in self.workers.values() if now - w.last_seen > timeout_s]

    # ---- queries over all workers --------------------------------------------------------

    @property
    def model(self) -> str:
        return next((w.hello.model for w in self.workers.values()), "")

    @property
    def max_model_len(self) -> int:
        return min((w.core.max_model_len for w in self.workers.values()), default=0)

    @property
    def vocab_size(self) -> int:
        return min((w.hello.vocab_size for w in self.workers.values()), default=0)

    @property
    def num_healthy(self) -> int:
        return sum(w.healthy for w in self.workers.values())

    @property
    def num_waiting(self) -> int:
        return sum(len(w.core.waiting) for w in self.workers.values())

    def make_stats(self) -> dict[str, WorkerStats]:
        return {wid: w.core.make_stats() for wid, w in self.workers.items()}

    # ---- placement -----------------------------------------------------------------------

    def select(self, request: Request) -> WorkerHandle:
        """The healthy worker where `request` costs least (`_cost`). Prefill workers take only
        the requests to disaggregate (`_disaggregates`), marked `prefill_only`; the others go
        to the decode and mixed workers, or to any worker when there are none."""
        healthy = [w for w in self.workers.values() if w.healthy and _serves_lora(w, request)]
        if not healthy:
            raise LookupError("no worker is ready")
        token_ids, root = request.all_token_ids, request.prefix_root
        uncached = {w.worker_id: w.core.num_uncached_blocks(token_ids, root) for w in healthy}
        prefill = [w for w in healthy if w.role == ROLE_PREFILL]
        serving = [w for w in healthy if w.role != ROLE_PREFILL]

        def cost(w: WorkerHandle) -> tuple[int, int]:
            return _cost(w, uncached[w.worker_id], request.lora_name)

        if prefill and serving and self._disaggregates(request, serving, uncached):
            request.prefill_only = True
            return min(prefill, key=cost)
        return min(serving or healthy, key=cost)

    def select_decode(self, request: Request, source: WorkerHandle) -> WorkerHandle | None:
        """The healthy decode or mixed worker other than `source` where `request`, handed
        over by the prefill worker `source`, costs least: by KV room and load (None: none)."""
        targets = [
            w
            for w in self.workers.values()
            if w.healthy and w.role != ROLE_PREFILL and w is not source and _serves_lora(w, request)
        ]
        token_ids, root, name = request.all_token_ids, request.prefix_root, request.lora_name
        return min(
            targets,
            key=lambda w: _cost(w, w.core.num_uncached_blocks(token_ids, root), name),
            default=None,
        )

    def _disaggregates(
        self, request: Request, serving: list[WorkerHandle], uncached: dict[str, int]
    ) -> bool:
        """Whether a new request's prompt, where it is cached most among the decode and mixed
        workers, leaves more than `disaggregation_threshold` tokens to compute. Requests with
        tokens already generated (moved ones), and those asking for prompt logprobs (computed
        where the prompt runs), are not disaggregated; nor anything without prefix caching,
        which the hand-over's fetch relies on."""
        if not self.config.enable_prefix_caching or request.num_output_tokens:
            return False
        if request.sampling_params.prompt_logprobs is not None:
            return False
        num_tokens = request.num_tokens

        def uncached_tokens(w: WorkerHandle) -> int:
            block_size = w.core.kv.block_size
            num_cached = num_tokens // block_size - uncached[w.worker_id]
            return num_tokens - num_cached * block_size

        return min(uncached_tokens(w) for w in serving) > self.config.disaggregation_threshold


def _serves_lora(worker: WorkerHandle, request: Request) -> bool:
    """Whether `worker` can run `request`: any worker a base request, one with LoRA slots an
    adapter's."""
    return request.lora is None or worker.hello.max_loras > 0


def _cost(
    worker: WorkerHandle, num_uncached_blocks: int, lora_name: str | None = None
) -> tuple[int, int]:
    """What a request costs on `worker`, whose prefix cache (all tiers) lacks
    `num_uncached_blocks` of its full blocks: those plus the blocks in use there, counted in
    tokens (blocks of that worker's own size times its block size, so workers with different
    block sizes compare fairly), plus the tokens of the requests queued there and not yet
    scheduled (so a burst spreads before any of it holds blocks), plus `LORA_LOAD_COST_TOKENS`
    where the request's adapter is not among those the worker last ran; ties go to the worker
    holding fewer requests."""
    core = worker.core
    blocks = num_uncached_blocks + core.num_used_blocks
    tokens = blocks * core.config.block_size + core.num_waiting_tokens
    if lora_name is not None and lora_name not in core.resident_loras:
        tokens += LORA_LOAD_COST_TOKENS
    return tokens, len(core.running) + len(core.waiting)
