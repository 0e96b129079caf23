"""One worker's step loop against a fake publisher: plans out, results in, stalls reset."""

from __future__ import annotations

import asyncio
import time

import msgspec

from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.request import FinishReason, Request
from services.scheduler.scheduler import RequestOutput
from services.scheduler.worker_driver import StepDeadline, WorkerDriver
from services.scheduler.worker_pool import WorkerHandle, WorkerPool
from shared.config import SchedulerConfig
from shared.sampling_params import SamplingParams
from shared.wire import BatchPlan, ModelRunnerOutput
from tests.scheduler.fakes import FakePublisher, make_hello


class Harness:
    def __init__(
        self, step_timeout_s: float = 30.0, async_scheduling: bool = False, per_token_s: float = 0.0
    ) -> None:
        config = SchedulerConfig(async_scheduling=async_scheduling)
        self.pool = WorkerPool(config)
        self.worker, _ = self.pool.register(make_hello())
        self.publisher = FakePublisher()
        self.outputs: list[RequestOutput] = []
        self.stalled: list[WorkerHandle] = []
        self.stalled_at: list[float] = []  # time.monotonic() of each stall
        self.metrics = SchedulerMetrics("m")
        self.driver = WorkerDriver(
            self.worker,
            publish=self.publisher,
            plan_subject="plan",
            epoch="e",
            deadline=StepDeadline(step_timeout_s, per_token_s),
            metrics=self.metrics,
            on_outputs=self.on_outputs,
            on_handoff=lambda _worker, request: self.handed_off.append(request),
            on_stall=self.on_stall,
        )
        self.handed_off: list[Request] = []

    def on_stall(self, worker: WorkerHandle) -> None:
        self.stalled.append(worker)
        self.stalled_at.append(time.monotonic())

    def heartbeat(self, step_id: int, progress: int) -> None:
        """The worker's heartbeat, as the service hands it to the pool."""
        beat = msgspec.structs.replace(make_hello(), step_id=step_id, progress=progress)
        self.pool.register(beat)

    async def on_outputs(self, outputs: list[RequestOutput]) -> None:
        self.outputs.extend(outputs)

    def add(self, req_id: str, max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.worker.core.add_request(Request(req_id, [5, 6, 7], params))
        self.driver.wake()

    async def next_plan(self, count: int) -> BatchPlan:
        """The `count`-th plan after the empty one that announces the session."""
        while len(self.publisher.sent) <= count:
            await asyncio.sleep(0.001)
        subject, plan = self.publisher.sent[count]
        assert subject == "plan" and isinstance(plan, BatchPlan)
        return plan

    @property
    def num_plans(self) -> int:
        """Plans sent after the announcement."""
        return len(self.publisher.sent) - 1


def result(plan: BatchPlan, token: int = 9) -> ModelRunnerOutput:
    req_ids = list(plan.num_scheduled_tokens)
    return ModelRunnerOutput(
        step_id=plan.step_id,
        worker_id="w0",
        req_ids=req_ids,
        sampled_token_ids=[[token] for _ in req_ids],
    )


def test_plans_until_the_request_finishes_then_idles():
    async def run() -> Harness:
        h = Harness()
        h.driver.start()
        await asyncio.sleep(0.01)
        assert h.num_plans == 0  # idle: nothing to schedule
        h.add("a", max_tokens=2)
        first = await h.next_plan(1)
        assert (first.scheduler_epoch, first.worker_session) == ("e", h.worker.session)
        h.driver.on_result(result(first, token=3))
        second = await h.next_plan(2)
        h.driver.on_result(result(first))  # a stale step id: ignored
        h.driver.on_result(result(second, token=4))
        third = await h.next_plan(3)  # tells the worker that "a" finished
        await asyncio.sleep(0.01)
        h.driver.stop()
        assert third.finished_req_ids == ["a"] and not third.num_scheduled_tokens
        return h

    h = asyncio.run(run())
    assert [(o.new_token_ids, o.finish_reason) for o in h.outputs] == [
        ([3], None),
        ([4], FinishReason.LENGTH),
    ]
    assert h.num_plans == 3 and h.stalled == []


def test_a_new_session_is_announced_by_an_empty_plan():
    """The worker drops what it held and knows it is adopted (its readiness), with no request
    to run; its answer is no result the driver waits for."""

    async def run() -> Harness:
        h = Harness(step_timeout_s=0.05)
        h.driver.start()
        await asyncio.sleep(0.01)
        announce = h.publisher.sent[0][1]
        assert isinstance(announce, BatchPlan)
        assert (announce.scheduler_epoch, announce.worker_session) == ("e", h.worker.session)
        assert not announce.num_scheduled_tokens and not announce.finished_req_ids
        await asyncio.sleep(0.1)  # past the step timeout: nothing awaited it
        h.add("a", max_tokens=1)
        plan = await h.next_plan(1)
        assert plan.step_id > announce.step_id
        h.driver.on_result(result(announce))  # ignored
        h.driver.on_result(result(plan))
        await asyncio.sleep(0.01)
        h.driver.stop()
        return h

    h = asyncio.run(run())
    assert h.stalled == [] and [o.finish_reason for o in h.outputs] == [FinishReason.LENGTH]


def test_a_lost_result_stalls_the_worker_once():
    async def run() -> Harness:
        h = Harness(step_timeout_s=0.05)
        h.driver.start()
        h.add("a", max_tokens=4)
        plan = await h.next_plan(1)
        await asyncio.sleep(0.2)
        h.driver.on_result(result(plan))  # too late: ignored
        h.driver.stop()
        return h

    h = asyncio.run(run())
    assert h.stalled == [h.worker] and h.outputs == [] and h.num_plans == 1


def test_async_keeps_two_plans_in_flight_and_drops_tokens_past_a_stop():
    async def run() -> Harness:
        h = Harness(async_scheduling=True)
        h.driver.start()
        h.add("a", max_tokens=10)
        first, second = await h.next_plan(1), await h.next_plan(2)  # no result yet
        assert second.num_scheduled_tokens == {"a": 1}
        await asyncio.sleep(0.01)
        assert h.num_plans == 2  # never a third before the first result
        h.driver.on_result(result(first, token=2))  # EOS: "a" stops while second runs
        third = await h.next_plan(3)
        assert third.finished_req_ids == ["a"] and not third.num_scheduled_tokens
        late = result(second, token=4)  # the extra token: dropped
        late.idle_s = 0.25  # the worker waited for this plan
        h.driver.on_result(late)
        h.driver.on_result(result(third))
        await asyncio.sleep(0.01)
        h.driver.stop()
        return h

    h = asyncio.run(run())
    assert [(o.new_token_ids, o.finish_reason) for o in h.outputs] == [([2], FinishReason.STOP)]
    idle = h.metrics.registry.get_sample_value(
        "skiff_worker_idle_seconds_total", {"worker_id": "w0"}
    )
    assert idle == 0.25
    assert h.num_plans == 3 and h.stalled == []


def test_async_a_lost_result_stalls_with_a_plan_behind_it():
    async def run() -> Harness:
        h = Harness(step_timeout_s=0.05, async_scheduling=True)
        h.driver.start()
        h.add("a", max_tokens=4)
        await h.next_plan(2)
        await asyncio.sleep(0.2)
        h.driver.stop()
        return h

    h = asyncio.run(run())
    assert h.stalled == [h.worker] and h.outputs == [] and h.num_plans == 2


def test_a_step_deadline_grows_with_its_tokens():
    async def run() -> Harness:
        h = Harness(step_timeout_s=0.05, per_token_s=0.1)  # 3 prompt tokens: 0.35 s
        h.driver.start()
        h.add("a", max_tokens=1)
        plan = await h.next_plan(1)
        await asyncio.sleep(0.15)  # past the base, within the deadline of its 3 tokens
        h.driver.on_result(result(plan))
        await asyncio.sleep(0.01)
        h.driver.stop()
        return h

    h = asyncio.run(run())
    assert h.stalled == [] and [o.finish_reason for o in h.outputs] == [FinishReason.LENGTH]


def test_step_deadline():
    assert StepDeadline(2.0, per_token_s=0.01).seconds(300) == 5.0
    assert StepDeadline(2.0).seconds(10**6) == 2.0


def test_a_long_step_reporting_progress_is_not_stalled():
    """A step five deadlines long whose worker reports progress on it twice per deadline."""

    async def run() -> Harness:
        h = Harness(step_timeout_s=0.1)
        h.driver.start()
        h.add("a", max_tokens=1)
        plan = await h.next_plan(1)
        for progress in range(1, 11):
            await asyncio.sleep(0.05)
            h.heartbeat(plan.step_id, progress)
        h.driver.on_result(result(plan))
        await asyncio.sleep(0.01)
        h.driver.stop()
        return h

    h = asyncio.run(run())
    assert h.stalled == [] and [o.finish_reason for o in h.outputs] == [FinishReason.LENGTH]


def test_a_step_stalls_one_deadline_after_its_last_progress():
    """Progress, then the same heartbeat over and over (a hung worker's, replayed) and
    progress on another step: the stall comes one deadline after the last progress on it."""

    async def run() -> tuple[Harness, float]:
        h = Harness(step_timeout_s=0.2)
        h.driver.start()
        h.add("a", max_tokens=1)
        plan = await h.next_plan(1)
        for progress in range(1, 5):
            await asyncio.sleep(0.05)
            last_progress = time.monotonic()
            h.heartbeat(plan.step_id, progress)
        for _ in range(8):
            await asyncio.sleep(0.05)
            h.heartbeat(plan.step_id, 4)  # no news
            h.heartbeat(plan.step_id + 7, 3)  # another step's, and lower: ignored
        h.driver.stop()
        return h, last_progress

    h, last_progress = asyncio.run(run())
    assert h.stalled == [h.worker] and h.outputs == []
    assert 0.2 <= h.stalled_at[0] - last_progress < 0.3


def test_a_step_without_progress_stalls_at_its_deadline():
    """Heartbeats that report no step (a worker idle or not started on it) do not extend it."""

    async def run() -> tuple[Harness, float]:
        h = Harness(step_timeout_s=0.15)
        h.driver.start()
        h.add("a", max_tokens=1)
        await h.next_plan(1)
        published = time.monotonic()
        for progress in range(1, 7):
            await asyncio.sleep(0.05)
            h.heartbeat(-1, progress)
        h.driver.stop()
        return h, published

    h, published = asyncio.run(run())
    assert h.stalled == [h.worker]
    assert 0.14 <= h.stalled_at[0] - published < 0.25  # seen up to a poll (1 ms) after sent
