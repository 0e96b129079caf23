"""The scheduling policy: "priority" orders the waiting queue by (priority, arrival time) and
preempts the running request with the largest of them; "fcfs" keeps arrival order and refuses
requests that carry a priority."""

from __future__ import annotations

import random
from collections import deque

import pytest

from services.scheduler.admission import Admission
from services.scheduler.placement import Placement
from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler import Scheduler
from services.scheduler.worker_pool import WorkerPool
from shared.cli_args import ConfigParser
from shared.config import SchedulerConfig
from shared.sampling_params import SamplingParams
from shared.wire import BatchPlan, ModelRunnerOutput, SubmitReply, SubmitRequest
from tests.scheduler.fakes import FakeWorker, make_hello
from tests.scheduler.test_async_scheduling import Run

EOS = 2


def make_core(policy: str, num_blocks: int = 64, budget: int = 512, **kw) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_model_len=512,
        block_size=16,
        scheduling_policy=policy,
        **kw,
    )
    return Scheduler(config, num_blocks, eos_token_ids=(EOS,))


def req(req_id: str, n_prompt: int, priority: int = 0, arrival: float | None = None, start=100):
    params = SamplingParams(temperature=0.0, max_tokens=20)
    request = Request(req_id, list(range(start, start + n_prompt)), params, priority=priority)
    if arrival is not None:
        request.arrival_time = arrival
    return request


def respond(plan: BatchPlan, core: Scheduler, token: int = 7) -> None:
    """One token for every scheduled request whose prompt is computed."""
    ids = list(plan.num_scheduled_tokens)
    sampled = [
        [token] if core.requests[i].num_computed_tokens >= core.requests[i].num_tokens else []
        for i in ids
    ]
    core.update(ModelRunnerOutput(step_id=plan.step_id, req_ids=ids, sampled_token_ids=sampled))


# ---- the waiting queue ---------------------------------------------------------------------

ARRIVALS = [("a", 1, 1.0), ("b", 0, 4.0), ("c", 1, 0.5), ("d", -2, 3.0), ("e", 0, 2.0)]


def admitted_one_at_a_time(policy: str) -> list[str]:
    core = make_core(policy, max_num_seqs=1)
    for name, priority, arrival in ARRIVALS:
        core.add_request(req(name, 4, priority, arrival))
    order = []
    while core.has_unfinished():
        plan = core.schedule()
        order += [n.req_id for n in plan.new_reqs]
        core.abort(list(plan.num_scheduled_tokens))  # make room for the next one
    return order


def test_priority_admits_by_priority_then_arrival():
    assert admitted_one_at_a_time("priority") == ["d", "e", "b", "c", "a"]
    core = make_core("priority")
    for name, priority, arrival in ARRIVALS:
        core.add_request(req(name, 4, priority, arrival))
    assert [r.req_id for r in core.waiting] == ["d", "e", "b", "c", "a"]
    core.abort(["e"])  # leaves the heap; the order of the rest holds
    assert [r.req_id for r in core.waiting] == ["d", "b", "c", "a"]
    assert core.num_waiting_tokens == 16


def test_fcfs_admits_in_the_order_added():
    assert admitted_one_at_a_time("fcfs") == ["a", "b", "c", "d", "e"]


def test_a_preempted_request_waits_at_its_own_place():
    """fcfs puts it back first; priority back by its (priority, arrival time)."""
    for policy, first in (("fcfs", "low"), ("priority", "urgent")):
        core = make_core(policy, num_blocks=4)
        core.add_request(req("high", 32, priority=0, arrival=1.0))
        core.add_request(req("low", 32, priority=3, arrival=2.0, start=500))
        respond(core.schedule(), core)  # both hold 2 full blocks; each needs a third
        core.add_request(req("urgent", 4, priority=1, arrival=3.0, start=900))
        plan = core.schedule()
        assert plan.preempted_req_ids == ["low"]
        assert core.waiting.peek().req_id == first


# ---- preemption ----------------------------------------------------------------------------


def test_priority_preempts_the_lowest_priority_not_the_latest_admitted():
    # 6 blocks of 16 tokens; three 32-token prompts take 2 blocks each.
    core = make_core("priority", num_blocks=6)
    for i, (name, priority) in enumerate((("first", 0), ("second", 1), ("third", 0))):
        core.add_request(req(name, 32, priority, arrival=float(i), start=1000 * i))
    respond(core.schedule(), core)
    plan = core.schedule()  # "first" needs a third block: "second" has the lowest priority
    assert plan.preempted_req_ids == ["second"]
    assert set(plan.num_scheduled_tokens) == {"first", "third"}
    assert core.requests["second"].status == RequestStatus.PREEMPTED


def test_fcfs_preempts_the_latest_admitted_whatever_its_priority():
    core = make_core("fcfs", num_blocks=6)
    for i, (name, priority) in enumerate((("first", 0), ("second", 1), ("third", 0))):
        core.add_request(req(name, 32, priority, arrival=float(i), start=1000 * i))
    respond(core.schedule(), core)
    assert core.schedule().preempted_req_ids == ["third"]


def test_among_equal_keys_the_latest_admitted_is_preempted():
    core = make_core("priority", num_blocks=6)
    for i, name in enumerate(("first", "second", "third")):
        core.add_request(req(name, 32, arrival=1.0, start=1000 * i))
    respond(core.schedule(), core)
    assert core.schedule().preempted_req_ids == ["third"]


def test_a_victim_scheduled_earlier_in_the_step_gives_its_tokens_back():
    # "low" runs first in `running` and fills its second block this step; "high" then needs
    # a third block, so "low" is taken out of the plan and preempted.
    core = make_core("priority", num_blocks=4)
    core.add_request(req("low", 30, priority=5, arrival=1.0))
    respond(core.schedule(), core)
    core.add_request(req("high", 32, priority=0, arrival=2.0, start=500))
    respond(core.schedule(), core)  # low decodes, high is admitted
    low = core.requests["low"]
    assert low.num_tokens == 32 and core.kv.num_free_blocks == 0
    plan = core.schedule()
    assert plan.preempted_req_ids == ["low"]
    assert plan.num_scheduled_tokens == {"high": 1} and plan.total_num_scheduled_tokens == 1
    assert [c.req_id for c in plan.cached_reqs] == ["high"]
    assert low.num_computed_tokens == 0 and low.num_output_placeholders == 0


def test_blocks_a_victim_filled_in_its_step_leave_the_prefix_cache():
    # "low" fills its second block this step (cached when allocated); "high" then needs three
    # blocks, more than "low" frees, so both are preempted and nothing reuses those blocks.
    core = make_core("priority", num_blocks=7, budget=48)
    core.add_request(req("low", 30, priority=5, arrival=1.0))
    core.add_request(req("mid", 18, priority=-1, arrival=0.5, start=900))  # holds 2 blocks
    respond(core.schedule(), core)
    core.add_request(req("high", 100, priority=0, arrival=2.0, start=500))
    respond(core.schedule(), core)  # low and mid decode; high prefills 46 tokens (3 blocks)
    low = core.requests["low"]
    assert low.num_tokens == 32 and core.kv.num_free_blocks == 0
    plan = core.schedule()
    assert plan.preempted_req_ids == ["low", "high"] and plan.num_scheduled_tokens == {"mid": 1}
    # block 0 of "low" was computed and stays findable; block 1 never got its last token's KV
    assert core.kv.num_cached_prefix_blocks(low.all_token_ids) == 1
    assert core.kv.num_cached_prefix_blocks(core.requests["high"].all_token_ids) == 2


class KVCheckingWorker(FakeWorker):
    """A FakeWorker that also keeps what each KV slot holds (the context it was computed for)
    and asserts that every position a plan hands over as computed holds its request's own
    once the step wrote its KV (a hit may be on blocks filled in the same step, as on a real
    worker, where each layer stores the batch's keys and values before attention)."""

    def __init__(self, block_size: int, **kw) -> None:
        super().__init__(**kw)
        self.block_size = block_size
        self.tables: dict[str, list[int]] = {}
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def _slot(self, req_id: str, pos: int) -> tuple[int, int]:
        return self.tables[req_id][pos // self.block_size], pos % self.block_size

    def _check_computed(self, req_id: str, tokens: list[int], num_computed: int) -> None:
        for pos in range(num_computed):
            held = self.slots.get(self._slot(req_id, pos))
            assert held == tuple(tokens[: pos + 1]), f"{req_id}: slot {pos} holds other KV"

    def execute(self, plan: BatchPlan) -> ModelRunnerOutput:
        for req_id in [*plan.finished_req_ids, *plan.preempted_req_ids]:
            self.tables.pop(req_id, None)
        handed_over = {new.req_id: new.num_computed_tokens for new in plan.new_reqs}
        for new in plan.new_reqs:
            self.tables[new.req_id] = list(new.block_ids)
        for cached in plan.cached_reqs:
            if cached.resumed:
                self.tables[cached.req_id] = list(cached.new_block_ids)
                handed_over[cached.req_id] = cached.num_computed_tokens
            else:
                self.tables[cached.req_id] += cached.new_block_ids
        output = super().execute(plan)
        for req_id, n in plan.num_scheduled_tokens.items():
            end, tokens = self.computed[req_id], self.tokens[req_id]
            for pos in range(end - n, end):
                self.slots[self._slot(req_id, pos)] = tuple(tokens[: pos + 1])
        for req_id, num_computed in handed_over.items():
            self._check_computed(req_id, self.tokens[req_id], num_computed)
        return output


def priority_workload(seed: int, count: int = 20) -> list[Request]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 1000) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    requests = []
    for i in range(count):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 1000) for _ in range(rng.randrange(20))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.choice([1, 5, 17, 30]))
        request = Request(f"r{i}", prompt, params, priority=rng.choice([-1, 0, 0, 2, 5]))
        request.arrival_time = float(i)
        requests.append(request)
    return requests


def run_policy(policy: str, seed: int, num_blocks: int, async_scheduling: bool) -> Run:
    config = SchedulerConfig(
        max_num_batched_tokens=48,
        max_num_seqs=8,
        max_model_len=48,  # within the tight pool: both runs stop at the same length
        block_size=4,
        async_scheduling=async_scheduling,
        scheduling_policy=policy,
    )
    core = Scheduler(config, num_blocks, eos_token_ids=(EOS,))
    # one request arrives before each step, so urgent ones find less urgent ones running
    arriving = deque(priority_workload(seed))
    schedule, has_unfinished = core.schedule, core.has_unfinished

    def arrive_and_schedule() -> BatchPlan:
        if arriving:
            core.add_request(arriving.popleft())
        return schedule()

    core.schedule = arrive_and_schedule
    core.has_unfinished = lambda: bool(arriving) or has_unfinished()
    unscheduled: list[int] = []  # tokens given back by each victim scheduled in its step
    unschedule = core._unschedule
    core._unschedule = lambda *args: unscheduled.append(unschedule(*args)) or unscheduled[-1]
    run = Run(core, KVCheckingWorker(4, eos=EOS, eos_every=9))
    run.step_all()
    run.num_unscheduled = sum(n > 0 for n in unscheduled)
    return run


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_priority_preemption_under_pressure_keeps_every_token(async_scheduling):
    """With a pool small enough to preempt often, sometimes requests already scheduled in
    the step, every request gets the tokens it gets with room for all, and no prefix-cache hit
    hands over KV that was never computed."""
    num_preemptions = num_unscheduled = 0
    for seed in range(16):
        roomy = run_policy("fcfs", seed, num_blocks=512, async_scheduling=async_scheduling)
        tight = run_policy("priority", seed, num_blocks=16, async_scheduling=async_scheduling)
        assert roomy.core.num_preemptions == 0
        assert tight.tokens == roomy.tokens and tight.finish == roomy.finish
        assert len(tight.finish) == 20
        assert tight.core.kv.num_free_blocks == tight.core.kv.num_blocks
        num_preemptions += tight.core.num_preemptions
        num_unscheduled += tight.num_unscheduled
    assert num_preemptions > 16 and num_unscheduled > 1  # not vacuous


# ---- admission and the flag ----------------------------------------------------------------


def admission(policy: str) -> Admission:
    pool = WorkerPool(SchedulerConfig(scheduling_policy=policy))
    pool.register(make_hello())
    return Admission(pool, Placement(pool, wake=lambda _: None), max_waiting=8)


def submit(priority: int) -> SubmitRequest:
    return SubmitRequest(
        req_id=f"r{priority}",
        gateway_id="gw",
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(),
        priority=priority,
    )


def test_fcfs_refuses_a_priority():
    reply = admission("fcfs").check(submit(3))
    assert reply == SubmitReply(
        accepted=False,
        status=400,
        message="Got priority 3 but Priority scheduling is not enabled.",
        param="priority",
    )
    assert admission("fcfs").check(submit(0)).accepted


def test_priority_policy_accepts_any_priority():
    for priority in (-5, 0, 7):
        assert admission("priority").check(submit(priority)).accepted


def test_scheduling_policy_flag():
    parser = ConfigParser()
    parser.add_config(SchedulerConfig)
    config = parser.parse_configs(["--scheduling-policy", "priority"])[1][SchedulerConfig]
    assert config.scheduling_policy == "priority"
    assert SchedulerConfig().scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match="scheduling_policy must be fcfs or priority"):
        SchedulerConfig(scheduling_policy="lifo")
    with pytest.raises(SystemExit):
        parser.parse_configs(["--scheduling-policy", "lifo"])
