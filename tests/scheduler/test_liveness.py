"""Workers coming, restarting and going silent: their requests move with their tokens."""

from __future__ import annotations

import asyncio

from services.scheduler.liveness import Liveness
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.placement import Placement
from services.scheduler.request import Request
from services.scheduler.scheduler import RequestOutput
from services.scheduler.worker_driver import WorkerDriver
from services.scheduler.worker_pool import WorkerHandle, WorkerPool
from shared.config import SchedulerConfig
from shared.protocol import BatchPlan
from shared.sampling_params import SamplingParams
from tests.scheduler.fakes import FakePublisher, make_hello


class Harness:
    def __init__(self) -> None:
        self.pool = WorkerPool(SchedulerConfig())
        self.metrics = SchedulerMetrics("m")
        self.publisher = FakePublisher()
        self.placement = Placement(self.pool, wake=lambda wid: self.liveness.wake(wid))
        self.liveness = Liveness(self.pool, self.placement, self.start_driver, self.metrics)

    def start_driver(self, worker: WorkerHandle) -> WorkerDriver:
        async def on_outputs(_: list[RequestOutput]) -> None:
            pass

        driver = WorkerDriver(
            worker,
            publish=self.publisher,
            plan_subject=f"plan.{worker.worker_id}",
            epoch="e",
            step_timeout_s=30.0,
            metrics=self.metrics,
            on_outputs=on_outputs,
            on_stall=lambda w: self.liveness.adopt(w.hello, fresh=True),
        )
        driver.start()
        return driver

    def place(self, req_id: str, output_token_ids: list[int]) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=50)
        self.placement.place(Request(req_id, [1, 2, 3], params, output_token_ids))


def test_a_silent_worker_loses_its_requests_to_a_live_one():
    async def run() -> Harness:
        h = Harness()
        h.liveness.adopt(make_hello("w0"))
        h.place("a", [7, 8])
        h.liveness.adopt(make_hello("w1"))  # arrives after "a" was placed on w0
        h.liveness.adopt(make_hello("w1"))  # a heartbeat of the same instance changes nothing
        assert h.placement.worker_of["a"].worker_id == "w0"
        h.pool.workers["w0"].last_seen -= 10
        h.liveness.expire(timeout_s=5)
        await asyncio.sleep(0.01)
        h.liveness.stop()
        return h

    h = asyncio.run(run())
    assert list(h.pool.workers) == ["w1"] and list(h.liveness.drivers) == []
    moved = h.pool.workers["w1"].core.requests["a"]
    assert moved.output_token_ids == [7, 8] and h.placement.worker_of["a"].worker_id == "w1"
    assert h.metrics.registry.get_sample_value("skiff_request_migrations_total") == 1
    assert h.publisher.sent[-1][0] == "plan.w1"


def test_requests_wait_for_a_worker_and_survive_a_restart():
    async def run() -> tuple[Harness, str]:
        h = Harness()
        h.place("a", [])
        assert [r.req_id for r in h.placement.unplaced] == ["a"]
        h.liveness.adopt(make_hello("w0"))
        assert h.placement.unplaced == [] and "a" in h.placement
        session = h.pool.workers["w0"].session
        h.liveness.adopt(make_hello("w0", instance_id="i1"))  # restarted: KV cache gone
        await asyncio.sleep(0.01)
        h.liveness.stop()
        return h, session

    h, old_session = asyncio.run(run())
    worker = h.pool.workers["w0"]
    assert worker.session != old_session and "a" in worker.core.requests
    last_plan = h.publisher.sent[-1][1]
    assert isinstance(last_plan, BatchPlan) and last_plan.worker_session == f"e:{worker.session}"
