"""Long prefills paced by measured step times (PrefillPacer): hand-built results whose
`execute_s` comes from a cost model of the step, no model."""

from __future__ import annotations

from collections import deque

import pytest

from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.sampling_params import SamplingParams
from shared.wire import BatchPlan, ModelRunnerOutput
from tests.scheduler.fakes import FakeWorker

EOS = 2
STEP_S = 0.01  # a step's fixed time
CONTEXT_SCALE = 3000  # context positions whose attention costs as much as a token's projections


def make_scheduler(budget=512, paced=True, max_len=8192, num_blocks=1024, **kw):
    if not paced:
        kw.update(long_prefill_step_time=0.0, long_prefill_share=1.0)
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_model_len=max_len,
        block_size=16,
        enable_prefix_caching=False,
        **kw,
    )
    return Scheduler(config, num_blocks, eos_token_ids=(EOS,))


def req(req_id, n_prompt, max_tokens=8, start=100):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id, [start + i % 500 for i in range(n_prompt)], params)


class TimedWorker(FakeWorker):
    """FakeWorker whose results report a step time: fixed part plus `token_s` per token,
    each token's weighted by its context (attention over the earlier tokens)."""

    def __init__(self, token_s: float) -> None:
        super().__init__(eos=EOS)
        self.token_s = token_s

    def execute(self, plan: BatchPlan) -> ModelRunnerOutput:
        output = super().execute(plan)
        output.execute_s = self.step_time(plan)
        return output

    def step_time(self, plan: BatchPlan) -> float:
        """Of a plan already executed (its requests' computed counts include it)."""
        cost = 0.0
        for req_id, n in plan.num_scheduled_tokens.items():
            context = self.computed[req_id] - n / 2
            cost += n * (1 + context / CONTEXT_SCALE)
        return STEP_S + self.token_s * cost


def step(sched: Scheduler, worker: TimedWorker) -> BatchPlan:
    plan = sched.schedule()
    sched.update(worker.execute(plan))
    return plan


def test_long_prompt_alone_takes_the_full_budget_when_steps_are_fast():
    sched, worker = make_scheduler(budget=512), TimedWorker(token_s=1e-5)
    sched.add_request(req("long", 3000, max_tokens=1))
    chunks = [step(sched, worker).num_scheduled_tokens["long"] for _ in range(5)]
    assert chunks == [512, 512, 512, 512, 512]


def test_long_prompt_alone_is_cut_to_the_step_time():
    sched, worker = make_scheduler(budget=512), TimedWorker(token_s=2e-3)
    sched.add_request(req("long", 3000, max_tokens=1))
    chunks, times = [], []
    while sched.has_unfinished():
        plan = step(sched, worker)
        chunks.append(plan.num_scheduled_tokens["long"])
        times.append(worker.step_time(plan))
    assert chunks[0] == 512  # no step measured yet
    assert sum(chunks) == 3000
    assert all(n < 512 for n in chunks[1:])
    # each later step is sized from the one before: its time stays near the limit
    assert max(times[2:]) < 1.2 * sched.config.long_prefill_step_time
    assert chunks[-2] < chunks[2]  # the context grows, so do the tokens' costs


def test_a_fresh_workers_first_long_chunk_is_cut_to_the_threshold():
    """A served worker reports step times: before its first prefill step was timed, a long
    prompt gets one threshold-sized chunk (not the whole budget), then chunks by measurement,
    so a short request right behind it on a fresh worker does not wait for a full-budget
    chunk."""
    config = SchedulerConfig(
        max_num_batched_tokens=2048, max_model_len=8192, long_prefill_token_threshold=200
    )
    sched, worker = Scheduler(config, 1024, (EOS,), timed_steps=True), TimedWorker(2e-3)
    sched.add_request(req("long", 6000, max_tokens=1))
    sched.add_request(req("short", 3, max_tokens=2, start=700))
    first = step(sched, worker).num_scheduled_tokens
    assert first == {"long": 200, "short": 3}
    assert step(sched, worker).num_scheduled_tokens == {"short": 1}  # a decode-only step
    assert 0 < step(sched, worker).num_scheduled_tokens["long"] < 2048  # sized by measurement
    untimed = Scheduler(config, 1024, (EOS,))  # the offline engine: nothing to measure by
    untimed.add_request(req("long", 6000, max_tokens=1))
    assert untimed.schedule().num_scheduled_tokens == {"long": 2048}


def test_running_decode_is_scheduled_every_step_and_the_long_prefill_gets_its_share():
    sched, worker = make_scheduler(budget=512), TimedWorker(token_s=2e-3)
    sched.add_request(req("d", 4, max_tokens=60))
    step(sched, worker)  # d's prompt
    decode_only = worker.step_time(step(sched, worker))
    assert sched.pacer.decode_s == pytest.approx(decode_only)
    sched.add_request(req("long", 3000, max_tokens=1, start=600))
    shared = []
    while "d" in sched.requests:
        plan = step(sched, worker)
        assert plan.num_scheduled_tokens.get("d") == 1
        shared.append((plan.num_scheduled_tokens.get("long", 0), worker.step_time(plan)))
    chunks = [n for n, _ in shared]
    assert 0 < max(chunks) < 512 and sum(chunks) > 0
    # share 0.5: the prefill takes about as long as the decode step, measured one step late
    assert max(t for _, t in shared[2:]) < 2.5 * decode_only
    alone = step(sched, worker).num_scheduled_tokens["long"]
    assert alone > 3 * max(chunks)  # d finished: the prompt gets the step time again


def test_short_request_behind_a_long_prompt_is_admitted_at_once():
    sched, worker = make_scheduler(budget=512), TimedWorker(token_s=2e-3)
    sched.add_request(req("long", 6000, max_tokens=1))
    for _ in range(4):
        step(sched, worker)
    sched.add_request(req("short", 3, max_tokens=4, start=700))
    plan = sched.schedule()
    assert plan.num_scheduled_tokens["short"] == 3 and plan.num_scheduled_tokens["long"] > 1
    outputs = sched.update(worker.execute(plan))
    assert [o.req_id for o in outputs] == ["short"]  # its first token, one step after arrival
    # short decodes now and no decode-only step was measured: the long prompt sits out one
    # step to measure it, then gets its share
    assert step(sched, worker).num_scheduled_tokens == {"short": 1}
    plan = step(sched, worker)
    assert plan.num_scheduled_tokens["short"] == 1 and plan.num_scheduled_tokens["long"] >= 1


def test_short_prompts_are_not_paced():
    sched, worker = make_scheduler(budget=512, long_prefill_token_threshold=300), TimedWorker(1.0)
    sched.add_request(req("d", 4, max_tokens=20))
    step(sched, worker)
    step(sched, worker)
    sched.add_request(req("short", 300, max_tokens=1, start=600))
    assert step(sched, worker).num_scheduled_tokens == {"d": 1, "short": 300}


def test_unmeasured_steps_are_not_paced():
    """Results without a step time (the offline engine's): chunks as without pacing."""
    sched = make_scheduler(budget=64)
    sched.add_request(req("d", 4, max_tokens=20))
    sched.add_request(req("long", 1000, max_tokens=1))
    worker = FakeWorker(eos=EOS)
    plans = []
    for _ in range(6):
        plan = sched.schedule()
        plans.append(plan.num_scheduled_tokens)
        sched.update(worker.execute(plan))
    assert plans[0] == {"d": 4, "long": 60}
    assert all(p == {"d": 1, "long": 63} for p in plans[1:])


def run_all(sched: Scheduler, worker: FakeWorker, requests: list[Request]) -> dict[str, list[int]]:
    """Every request to completion with two plans in flight, as the offline engine runs."""
    for r in requests:
        sched.add_request(r)
    tokens: dict[str, list[int]] = {r.req_id: [] for r in requests}
    in_flight: deque[ModelRunnerOutput] = deque()
    while sched.has_unfinished() or in_flight:
        while len(in_flight) < sched.max_plans_in_flight and sched.has_unfinished():
            in_flight.append(worker.execute(sched.schedule()))
        for out in sched.update(in_flight.popleft()):
            tokens[out.req_id].extend(out.new_token_ids)
    return tokens


def test_pacing_leaves_outputs_unchanged():
    def requests() -> list[Request]:
        return [req("long", 2500, max_tokens=5)] + [
            req(f"s{i}", 5 + i, max_tokens=30, start=800 + i) for i in range(4)
        ]

    paced = run_all(make_scheduler(budget=256), TimedWorker(2e-3), requests())
    unpaced = run_all(make_scheduler(budget=256, paced=False), TimedWorker(2e-3), requests())
    assert paced == unpaced
    assert [len(t) for t in paced.values()] == [5, 30, 30, 30, 30]


def test_threshold_defaults_to_four_percent_of_the_context():
    assert make_scheduler(max_len=8192).long_prefill_threshold == 327
    assert make_scheduler(long_prefill_token_threshold=64).long_prefill_threshold == 64


@pytest.mark.parametrize(
    "bad",
    [
        {"long_prefill_share": 0.0},
        {"long_prefill_share": 1.5},
        {"long_prefill_step_time": -1.0},
        {"long_prefill_token_threshold": -1},
    ],
)
def test_config_checks(bad):
    with pytest.raises(ValueError):
        SchedulerConfig(**bad)
