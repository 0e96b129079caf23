"""Workers coming, restarting and going silent: their requests move with their tokens."""

from __future__ import annotations

import asyncio

from services.scheduler.liveness import Liveness
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.placement import Placement
from services.scheduler.probe import HealthProbe
from services.scheduler.request import Request
from services.scheduler.scheduler import RequestOutput
from services.scheduler.worker_driver import StepDeadline, WorkerDriver
from services.scheduler.worker_pool import WorkerHandle, WorkerPool
from shared.config import SchedulerConfig
from shared.sampling_params import SamplingParams
from shared.wire import BatchPlan, ModelRunnerOutput, WorkerGoodbye
from tests.scheduler.fakes import FakePublisher, FakeWorker, make_hello


class Harness:
    def __init__(self, step_timeout_s: float = 30.0, max_request_failures: int = 2) -> None:
        self.pool = WorkerPool(SchedulerConfig())
        self.metrics = SchedulerMetrics("m")
        self.publisher = FakePublisher()
        self.step_timeout_s = step_timeout_s
        self.placement = Placement(self.pool, wake=lambda wid: self.liveness.wake(wid))
        self.failed: list[tuple[str, str]] = []  # (req_id, error) of requests failed
        self.liveness = Liveness(
            self.pool,
            self.placement,
            self.start_driver,
            self.start_probe,
            self.metrics,
            max_request_failures=max_request_failures,
            fail_request=lambda request, error: self.failed.append((request.req_id, error)),
        )

    def start_driver(self, worker: WorkerHandle) -> WorkerDriver:
        async def on_outputs(_: list[RequestOutput]) -> None:
            pass

        driver = WorkerDriver(
            worker,
            publish=self.publisher,
            plan_subject=f"plan.{worker.worker_id}",
            epoch="e",
            deadline=StepDeadline(self.step_timeout_s),
            metrics=self.metrics,
            on_outputs=on_outputs,
            on_handoff=self.placement.hand_off,
            on_stall=self.liveness.on_stall,
        )
        driver.start()
        return driver

    def start_probe(self, worker: WorkerHandle) -> HealthProbe:
        probe = HealthProbe(
            worker,
            publish=self.publisher,
            plan_subject=f"plan.{worker.worker_id}",
            epoch="e",
            interval_s=self.step_timeout_s,
            on_healthy=self.liveness.on_healthy,
        )
        probe.start()
        return probe

    def place(self, req_id: str, output_token_ids: list[int]) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=50)
        self.placement.place(Request(req_id, [1, 2, 3], params, output_token_ids))

    def plans(self, worker_id: str) -> list[BatchPlan]:
        return [
            m
            for s, m in self.publisher.sent
            if s == f"plan.{worker_id}" and isinstance(m, BatchPlan)
        ]

    async def serve(self, worker_id: str) -> None:
        """Answer every plan sent to `worker_id` as a healthy worker would."""
        worker, done = FakeWorker(), 0
        while True:
            plans = self.plans(worker_id)
            for plan in plans[done:]:
                output = worker.execute(plan)
                output.worker_id = worker_id
                self.liveness.on_result(output)
            done = len(plans)
            await asyncio.sleep(0.005)

    def metric(self, name: str, worker_id: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, {"worker_id": worker_id})


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


def test_a_leaving_worker_loses_its_requests_at_once():
    async def run() -> Harness:
        h = Harness()
        h.liveness.adopt(make_hello("w0"))
        h.place("a", [7, 8])
        h.liveness.adopt(make_hello("w1"))
        h.liveness.leave(WorkerGoodbye(worker_id="w0", instance_id="old"))  # another instance
        h.liveness.leave(WorkerGoodbye(worker_id="w9", instance_id="i0"))  # unknown
        assert h.placement.worker_of["a"].worker_id == "w0"
        h.liveness.leave(WorkerGoodbye(worker_id="w0", instance_id="i0"))
        await asyncio.sleep(0.01)
        h.liveness.stop()
        return h

    h = asyncio.run(run())
    assert list(h.pool.workers) == ["w1"] and h.placement.worker_of["a"].worker_id == "w1"
    assert h.pool.workers["w1"].core.requests["a"].output_token_ids == [7, 8]
    assert h.metric("skiff_worker_healthy", "w0") is None
    assert h.metrics.registry.get_sample_value("skiff_request_migrations_total") == 1


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
    assert isinstance(last_plan, BatchPlan)
    assert (last_plan.scheduler_epoch, last_plan.worker_session) == ("e", worker.session)


def test_a_hung_worker_loses_its_requests_until_it_answers_a_probe():
    async def run() -> None:
        h = Harness(step_timeout_s=0.1)
        h.liveness.adopt(make_hello("w0"))
        h.place("a", [7, 8])  # on w0, which then hangs: no result ever comes
        h.liveness.adopt(make_hello("w1"))
        w1 = asyncio.create_task(h.serve("w1"))
        await asyncio.sleep(0.3)
        # w0 missed its deadline: "a" moved to w1 with its tokens, though w0 is as cheap now
        assert h.placement.worker_of["a"].worker_id == "w1"
        moved = [n for plan in h.plans("w1") for n in plan.new_reqs if n.req_id == "a"]
        assert [n.output_token_ids for n in moved] == [[7, 8]]
        w0 = h.pool.workers["w0"]
        assert not w0.healthy and "w0" in h.liveness.probes and "w0" not in h.liveness.drivers
        assert h.metric("skiff_worker_step_timeouts_total", "w0") == 1
        assert h.metric("skiff_worker_healthy", "w0") == 0
        assert h.metric("skiff_worker_healthy", "w1") == 1
        assert h.pool.num_healthy == 1

        probes = [
            p for p in h.plans("w0") if (p.scheduler_epoch, p.worker_session) == ("e", w0.session)
        ]
        assert len(probes) >= 2  # sent again every interval while unanswered
        assert all(not p.num_scheduled_tokens and not p.new_reqs for p in probes)
        h.liveness.adopt(make_hello("w0"))  # its heartbeat alone proves nothing
        h.place("b", [])
        assert h.placement.worker_of["b"].worker_id == "w1" and not w0.healthy

        stale = h.plans("w0")[0].step_id  # a late result of its old session's step
        h.liveness.on_result(ModelRunnerOutput(step_id=stale, worker_id="w0"))
        await asyncio.sleep(0.01)
        assert not w0.healthy
        h.liveness.on_result(ModelRunnerOutput(step_id=probes[-1].step_id, worker_id="w0"))
        await asyncio.sleep(0.01)
        assert w0.healthy and "w0" in h.liveness.drivers and "w0" not in h.liveness.probes
        assert h.metric("skiff_worker_healthy", "w0") == 1
        h.place("c", [])  # w0 holds nothing now: the cheapest again
        assert h.placement.worker_of["c"].worker_id == "w0"
        w1.cancel()
        h.liveness.stop()

    asyncio.run(run())


def test_an_unhealthy_worker_restarted_is_healthy():
    async def run() -> None:
        h = Harness(step_timeout_s=0.05)
        h.liveness.adopt(make_hello("w0"))
        h.place("a", [])
        await asyncio.sleep(0.15)
        assert not h.pool.workers["w0"].healthy
        assert h.placement.unplaced and h.placement.unplaced[0].req_id == "a"  # no other worker
        h.liveness.adopt(make_hello("w0", instance_id="i1"))  # a new process
        assert h.pool.workers["w0"].healthy and "w0" not in h.liveness.probes
        assert h.placement.worker_of["a"].worker_id == "w0"
        h.liveness.expire(timeout_s=-1)  # silent: gone, and so is its gauge
        assert h.metric("skiff_worker_healthy", "w0") is None
        h.liveness.stop()

    asyncio.run(run())


async def serve_until(h: Harness, worker_id: str, poison: str) -> None:
    """Serve `worker_id` until a plan schedules `poison`, then hang (answer nothing more)."""
    worker, done = FakeWorker(), 0
    while True:
        plans = h.plans(worker_id)
        for plan in plans[done:]:
            if poison in plan.num_scheduled_tokens:
                return
            output = worker.execute(plan)
            output.worker_id = worker_id
            h.liveness.on_result(output)
        done = len(plans)
        await asyncio.sleep(0.005)


def test_a_request_in_the_steps_of_two_stalled_workers_fails_and_the_others_move():
    """ "p" hangs every worker that runs it. w0 stalls with it: it moves to w1, where it hangs
    "b" too. At its second stall "p" fails; "b" (one stall) moves on to w2."""

    async def run() -> Harness:
        h = Harness(step_timeout_s=0.1)
        h.liveness.adopt(make_hello("w0"))
        h.place("p", [])  # w0 never answers
        h.liveness.adopt(make_hello("w1"))
        w1 = asyncio.create_task(serve_until(h, "w1", "p"))
        h.place("b", [])  # w1: w0 holds "p"
        assert h.placement.worker_of["b"].worker_id == "w1"
        await asyncio.sleep(0.15)  # w0 stalled: "p" joins "b" on w1, which hangs
        assert h.placement.worker_of["p"].worker_id == "w1" and h.failed == []
        await asyncio.sleep(0.15)
        assert [req_id for req_id, _ in h.failed] == ["p"]
        assert "p" not in h.placement and [r.req_id for r in h.placement.unplaced] == ["b"]
        h.liveness.adopt(make_hello("w2"))
        assert h.pool.workers["w2"].core.requests["b"].num_failures == 1
        w2 = asyncio.create_task(h.serve("w2"))
        await asyncio.sleep(0.05)
        w1.cancel()
        w2.cancel()
        h.liveness.stop()
        return h

    h = asyncio.run(run())
    assert "stalled or failed" in h.failed[0][1]
    assert any(n.req_id == "b" for plan in h.plans("w2") for n in plan.new_reqs)
    assert all(n.req_id != "p" for plan in h.plans("w2") for n in plan.new_reqs)


def test_lost_workers_count_only_for_the_requests_of_their_steps_in_flight():
    """A new instance (a failed step) and silence both count for the requests in flight; a
    goodbye and a waiting request count nothing."""

    async def run() -> Harness:
        h = Harness(max_request_failures=2)
        h.liveness.adopt(make_hello("w0"))
        h.place("a", [])
        await asyncio.sleep(0.01)  # "a" in the step in flight; no result comes
        h.liveness.adopt(make_hello("w0", instance_id="i1"))  # its step failed
        assert h.pool.workers["w0"].core.requests["a"].num_failures == 1
        h.liveness.leave(WorkerGoodbye(worker_id="w0", instance_id="i1"))  # not a failure
        assert [r.num_failures for r in h.placement.unplaced] == [1]
        h.liveness.adopt(make_hello("w0", instance_id="i2"))
        await asyncio.sleep(0.01)  # in flight again
        h.pool.workers["w0"].last_seen -= 10
        h.liveness.expire(timeout_s=5)  # lost: the second failure
        h.liveness.stop()
        return h

    h = asyncio.run(run())
    assert [req_id for req_id, _ in h.failed] == ["a"] and h.placement.num_requests == 0
