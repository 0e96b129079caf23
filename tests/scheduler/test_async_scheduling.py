"""Async scheduling in the core: plans built before the previous step's result arrives give the
same tokens as one plan at a time, and nothing past a stop condition is ever emitted."""

from __future__ import annotations

import random
from collections import deque

import pytest

from services.scheduler.request import Request
from services.scheduler.scheduler import RequestOutput, Scheduler, plan_has_work
from shared.config import SchedulerConfig
from shared.sampling_params import SamplingParams
from shared.wire import BatchPlan, ModelRunnerOutput, decoder, encode
from tests.scheduler.fakes import FakeWorker

EOS = 2


def make_core(async_scheduling: bool, num_blocks: int = 64, budget: int = 48) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=8,
        max_model_len=256,
        block_size=4,
        async_scheduling=async_scheduling,
    )
    return Scheduler(config, num_blocks, eos_token_ids=(EOS,))


def mixed_workload(seed: int, count: int = 12) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(
            temperature=0.0,
            max_tokens=rng.choice([1, 2, 5, 17, None]),
            min_tokens=rng.choice([0, 0, 3]),
            stop_token_ids=rng.sample(range(3, 1000), 40) if rng.random() < 0.3 else [],
            ignore_eos=rng.random() < 0.1,
        )
        requests.append(Request(f"r{i}", prompt, params))
    return requests


class Run:
    """Steps a core against a FakeWorker with up to `core.max_plans_in_flight` plans
    executed ahead of their results (the worker runs plans in order, as the real one)."""

    def __init__(self, core: Scheduler, worker: FakeWorker) -> None:
        self.core, self.worker = core, worker
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.max_in_flight_seen = 0
        self.plans: list[BatchPlan] = []

    def step_all(self) -> None:
        in_flight: deque[ModelRunnerOutput] = deque()
        while self.core.has_unfinished() or in_flight:
            while len(in_flight) < self.core.max_plans_in_flight and self.core.has_unfinished():
                plan = self.core.schedule()
                if not plan_has_work(plan):
                    break
                self.plans.append(plan)
                wire_plan = decoder(BatchPlan).decode(encode(plan))
                in_flight.append(self.worker.execute(wire_plan))
                self.max_in_flight_seen = max(self.max_in_flight_seen, len(in_flight))
            assert in_flight, "no progress"
            self.record(self.core.update(in_flight.popleft()))

    def record(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            assert out.req_id not in self.finish, f"{out.req_id}: output after it finished"
            self.tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.finish[out.req_id] = out.finish_reason.value


def run(async_scheduling: bool, seed: int, **core_kw) -> Run:
    core = make_core(async_scheduling, **core_kw)
    for request in mixed_workload(seed):
        core.add_request(request)
    r = Run(core, FakeWorker(eos=EOS, eos_every=9))
    r.step_all()
    return r


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [64, 14])  # 14: preemptions with plans in flight
def test_async_equals_sync_token_for_token(seed, num_blocks):
    sync, async_ = run(False, seed, num_blocks=num_blocks), run(True, seed, num_blocks=num_blocks)
    assert sync.max_in_flight_seen == 1 and async_.max_in_flight_seen == 2
    assert async_.tokens == sync.tokens and async_.finish == sync.finish
    assert len(async_.finish) == 12
    for request in mixed_workload(seed):  # nothing past a stop condition
        tokens, params = async_.tokens.get(request.req_id, []), request.sampling_params
        if params.max_tokens is not None:
            assert len(tokens) <= params.max_tokens
        stops = ({EOS} if not params.ignore_eos else set()) | set(params.stop_token_ids)
        hits = [i for i, t in enumerate(tokens) if t in stops and i + 1 >= params.min_tokens]
        assert not hits or hits[0] == len(tokens) - 1


def test_workload_exercises_drops_and_preemption():
    """The equality above is not vacuous: requests stop while their next step is in flight,
    and the small pool preempts requests whose tokens are in flight."""
    r = run(True, seed=1, num_blocks=14)
    extra = sum(
        1
        for i, plan in enumerate(r.plans)
        for later in r.plans[i + 1 :]
        for req_id in plan.finished_req_ids
        if req_id in later.num_scheduled_tokens
    )
    scheduled_after_finish = {
        req_id
        for i, plan in enumerate(r.plans[1:], start=1)
        for req_id in plan.finished_req_ids
        if req_id in r.plans[i - 1].num_scheduled_tokens and req_id in r.finish
    }
    assert extra == 0  # a request told finished is never scheduled again
    assert scheduled_after_finish  # ... but some were scheduled in the step after they stopped
    assert r.core.num_preemptions > 0


def test_placeholder_lets_the_next_plan_run_the_sampled_token():
    core = make_core(True)
    core.add_request(Request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3)))
    first = core.schedule()
    second = core.schedule()  # before first's result
    assert first.num_scheduled_tokens == {"a": 3} and second.num_scheduled_tokens == {"a": 1}
    assert second.cached_reqs[0].num_computed_tokens == 3  # the position of first's token
    assert core.requests["a"].num_output_placeholders == 2
    out = core.update(ModelRunnerOutput(step_id=0, req_ids=["a"], sampled_token_ids=[[9]]))
    assert [o.new_token_ids for o in out] == [[9]]
    assert core.requests["a"].num_output_placeholders == 1


def test_a_request_capped_by_tokens_in_flight_is_not_scheduled():
    core = make_core(True)
    core.add_request(Request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2)))
    core.schedule(), core.schedule()
    assert core.schedule().num_scheduled_tokens == {}  # its 2 tokens are in flight


def test_stop_in_flight_drops_the_extra_token_and_frees_blocks():
    core = make_core(True)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    core.add_request(Request("a", [5, 6, 7], params))
    first, second = core.schedule(), core.schedule()
    out = core.update(
        ModelRunnerOutput(step_id=first.step_id, req_ids=["a"], sampled_token_ids=[[EOS]])
    )
    assert [(o.new_token_ids, o.finish_reason.value) for o in out] == [([EOS], "stop")]
    assert core.kv.num_free_blocks == core.kv.num_blocks
    late = ModelRunnerOutput(step_id=second.step_id, req_ids=["a"], sampled_token_ids=[[11]])
    assert core.update(late) == []  # never streamed, never counted
    assert core.schedule().finished_req_ids == ["a"]


def test_preempted_request_keeps_its_token_from_a_step_in_flight():
    core = make_core(True, num_blocks=2)  # 8 slots
    core.add_request(Request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=9)))
    first = core.schedule()  # a: 3 prompt tokens, samples -> placeholder
    core.add_request(Request("b", [8, 9, 10, 11], SamplingParams(temperature=0.0, max_tokens=9)))
    second = core.schedule()  # a decodes its placeholder token; b admitted
    assert second.num_scheduled_tokens == {"a": 1, "b": 4}
    third_needs_blocks = core.update(
        ModelRunnerOutput(step_id=first.step_id, req_ids=["a"], sampled_token_ids=[[20]])
    )
    assert [o.new_token_ids for o in third_needs_blocks] == [[20]]
    third = core.schedule()  # a (5 tokens) and b (5) do not fit 8 slots: b is preempted
    assert third.preempted_req_ids == ["b"]
    b = core.requests["b"]
    assert b.num_output_placeholders == 0 and b.num_computed_tokens == 0
    out = core.update(
        ModelRunnerOutput(
            step_id=second.step_id, req_ids=["a", "b"], sampled_token_ids=[[21], [30]]
        )
    )
    assert {o.req_id: o.new_token_ids for o in out} == {"a": [21], "b": [30]}
    assert b.output_token_ids == [30]  # resumes with it: the worker holds it too
