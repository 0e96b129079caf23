"""PrefillPacer's step-time model (fixed + per-token part): a step's fixed part, as large as the
step-time budget on a slow CPU, does not shrink a long prompt's chunks toward one token."""

from __future__ import annotations

import pytest

from services.scheduler.prefill_pacer import HISTORY, PrefillPacer
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.sampling_params import SamplingParams
from shared.wire import BatchPlan, ModelRunnerOutput
from tests.scheduler.fakes import FakeWorker

EOS = 2
BUDGET = 0.5  # long_prefill_step_time
TOKEN_S = 1e-3  # a prefill token's seconds at context 0


class FixedCostWorker(FakeWorker):
    """Results timed as fixed + per token (growing with the token's context by 1/`scale`)
    + `gather` for each prefill chunk (its KV context gathered again, as the torch fallback
    does)."""

    def __init__(self, fixed: float, gather: float = 0.0, scale: float = 1e9) -> None:
        super().__init__(eos=EOS)
        self.fixed, self.gather, self.scale = fixed, gather, scale

    def execute(self, plan: BatchPlan) -> ModelRunnerOutput:
        output = super().execute(plan)
        output.execute_s = self.step_time(plan)
        return output

    def step_time(self, plan: BatchPlan) -> float:
        """Of a plan already executed (its requests' computed counts include it)."""
        seconds = self.fixed
        for req_id, n in plan.num_scheduled_tokens.items():
            context = self.computed[req_id] - n / 2
            seconds += n * TOKEN_S * (1 + context / self.scale) + (self.gather if n > 1 else 0)
        return seconds


def make_scheduler() -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=2048,
        max_model_len=16384,
        block_size=16,
        enable_prefix_caching=False,
        long_prefill_step_time=BUDGET,
    )
    return Scheduler(config, 2048, eos_token_ids=(EOS,), timed_steps=True)


def req(req_id: str, n_prompt: int, max_tokens: int = 1, start: int = 100) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id, [start + i % 500 for i in range(n_prompt)], params)


def step(sched: Scheduler, worker: FakeWorker) -> BatchPlan:
    plan = sched.schedule()
    sched.update(worker.execute(plan))
    return plan


def long_chunks(
    fixed: float, num_steps: int, gather: float = 0.0, decode: bool = False
) -> list[int]:
    """A long prompt's chunks, alone or next to a decoding request."""
    sched, worker = make_scheduler(), FixedCostWorker(fixed, gather)
    if decode:
        sched.add_request(req("d", 4, max_tokens=1000, start=700))
        step(sched, worker)  # d's prompt
        step(sched, worker)  # a decode-only step
    sched.add_request(req("long", 12000))
    chunks = []
    for _ in range(num_steps):
        plan = step(sched, worker)
        assert not decode or plan.num_scheduled_tokens["d"] == 1  # d decodes every step
        chunks.append(plan.num_scheduled_tokens["long"])
    return chunks


def assert_paced(chunks: list[int], tokens: float) -> None:
    """Chunks of `tokens` (the budget over the per-token time), but for one in HISTORY + 1 at
    most, halved for the fixed part to be fitted again."""
    assert sorted(chunks)[len(chunks) // 2] >= 0.95 * tokens, chunks
    assert all(0.45 * tokens <= n <= 1.05 * tokens for n in chunks), chunks
    assert sum(n < 0.95 * tokens for n in chunks) <= -(-len(chunks) // (HISTORY + 1)), chunks


def test_a_fixed_part_near_the_budget_leaves_the_budget_to_the_tokens() -> None:
    """Fixed 0.45 s + 1 ms/token against 0.5 s: measured as seconds over tokens the chunk
    shrinks to (0.5 - 0.45) / 1 ms = 50 tokens; the model gives the tokens the whole budget."""
    chunks = long_chunks(fixed=0.45, num_steps=16)
    assert_paced(chunks[6:], BUDGET / TOKEN_S)


def test_a_fixed_part_over_the_budget_does_not_starve_the_prompt() -> None:
    """Fixed 0.6 s > 0.5 s: each step still computes budget / per-token tokens, so 12,000
    tokens take tens of steps, not thousands."""
    sched, worker = make_scheduler(), FixedCostWorker(fixed=0.6)
    sched.add_request(req("long", 12000))
    chunks = []
    while sched.has_unfinished():
        chunks.append(step(sched, worker).num_scheduled_tokens["long"])
        assert len(chunks) < 40, chunks
    assert_paced(chunks[8:-1], BUDGET / TOKEN_S)


def test_a_requests_own_fixed_part_next_to_decodes_does_not_shrink_its_chunks() -> None:
    """Each prefill step gathers the prompt's context again (0.3 s), more than the 0.2 s the
    decode share gives it: chunks still get the share for their tokens."""
    chunks = long_chunks(fixed=0.2, gather=0.3, num_steps=16, decode=True)
    share_s = 0.2 + TOKEN_S  # the decode-only step, share 0.5
    assert_paced(chunks[6:], share_s / TOKEN_S)


def test_the_decode_share_holds_when_the_fixed_part_is_small() -> None:
    """A fast device: fixed 10 ms, per-token cost growing with the context. Prefill chunks
    next to a decode stay within the share: the step takes about twice a decode-only step."""
    sched, worker = make_scheduler(), FixedCostWorker(fixed=0.01, scale=3000)
    sched.add_request(req("d", 4, max_tokens=80, start=700))
    step(sched, worker)
    decode_only = worker.step_time(step(sched, worker))
    sched.add_request(req("long", 3000))
    shared = []
    while "d" in sched.requests:
        plan = step(sched, worker)
        assert plan.num_scheduled_tokens["d"] == 1
        shared.append((plan.num_scheduled_tokens.get("long", 0), worker.step_time(plan)))
    assert all(n >= 2 for n, _ in shared[1:]), shared
    assert max(t for _, t in shared[3:]) < 2.3 * decode_only, shared


def observe(pacer: PrefillPacer, step_id: int, tokens: int, context: int, seconds: float) -> None:
    """One prefill step of request "r", alone, timed `seconds`."""
    pacer.record(step_id, {"r": (tokens, context)}, 0)
    pacer.observe(ModelRunnerOutput(step_id=step_id, req_ids=["r"], execute_s=seconds))


def test_the_fit_separates_the_fixed_part_from_the_context_growing_per_token_part() -> None:
    pacer = PrefillPacer(SchedulerConfig())
    fixed, per_token, per_work = 0.3, 1e-3, 1e-3 / 3000
    context = 0
    for tokens in (600, 250, 400, 300):
        work = tokens * (context + (tokens + 1) / 2)
        observe(pacer, context, tokens, context, fixed + tokens * per_token + work * per_work)
        context += tokens
    last = 300 * (per_token + per_work * (context - 300 + 301 / 2))  # the last step's tokens
    assert pacer.rate("r") == pytest.approx(last / 300, rel=1e-6)
    assert pacer.costs["r"].fixed_s[False] == pytest.approx(fixed, rel=1e-6)


def test_steps_alike_in_tokens_are_measured_as_seconds_over_tokens() -> None:
    """Without steps far enough apart in tokens to fit a line through, the rate is measured as
    before the model: the step's seconds over its tokens, smoothed."""
    pacer = PrefillPacer(SchedulerConfig())
    observe(pacer, 0, 400, 0, 0.8)
    assert pacer.rate("r") == pytest.approx(0.8 / 400)
    observe(pacer, 1, 380, 400, 0.76)
    observe(pacer, 2, 420, 780, 0.84)
    assert pacer.rate("r") == pytest.approx(2e-3)
    assert not pacer.costs["r"].fixed_s


def test_a_chunk_stuck_at_the_smallest_size_is_probed_larger() -> None:
    """Two-token chunks whose step is all fixed part (0.5 s): the next chunk is sized as if at
    most MIN_TOKEN_PART of the step were its tokens', then fitted; the rate falls to the
    per-token 1 ms within a few steps (at most MAX_SPEEDUP times a step)."""
    pacer = PrefillPacer(SchedulerConfig())
    observe(pacer, 0, 2, 0, 0.502)
    assert PrefillPacer.chunk(10000, pacer.rate("r"), 0.2) == 2
    observe(pacer, 1, 2, 2, 0.502)
    context, chunks = 4, [PrefillPacer.chunk(10000, pacer.rate("r"), 0.2)]
    assert chunks[0] > 10
    for step_id in range(2, 8):
        observe(pacer, step_id, chunks[-1], context, 0.5 + chunks[-1] * 1e-3)
        context += chunks[-1]
        chunks.append(PrefillPacer.chunk(10000, pacer.rate("r"), 0.2))
    assert pacer.rate("r") == pytest.approx(1e-3, rel=0.05), chunks


def test_a_model_is_forgotten_with_its_request() -> None:
    pacer = PrefillPacer(SchedulerConfig())
    observe(pacer, 0, 400, 0, 0.8)
    pacer.forget("r")
    assert "r" not in pacer.costs and pacer.rate("r") == pytest.approx(0.8 / 400)
