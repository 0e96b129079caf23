"""A worker's liveness (a wedged step), readiness (adopted by a scheduler), metrics and
goodbye; the service over a real nats-server with a simulated runner (no torch)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.worker.config import RunnerConfig, SimConfig, WorkerHttpConfig, WorkerServiceConfig
from services.worker.health import StepWatch, WorkerProbes
from services.worker.service import WorkerService
from services.worker.sim_runner import SimRunner
from shared import bus
from shared.sampling_params import SamplingParams
from shared.subjects import Subjects
from shared.wire import (
    BatchPlan,
    ModelRunnerOutput,
    NewRequestData,
    WorkerGoodbye,
    WorkerHello,
)
from tests.worker.test_sim_runner import write_model_config


def test_a_step_is_wedged_past_the_floor_and_the_factor_times_the_mean():
    watch = StepWatch(timeout_s=0.05, factor=10)
    assert watch.check() is None  # no step running
    watch.begin()
    time.sleep(0.08)
    assert "wedged after 0 s" in (watch.check() or "")  # first step: the floor alone
    watch.end(0.08, count=False)  # an empty plan: not averaged
    assert watch.mean_s is None and watch.check() is None
    watch.end(0.02)
    assert watch.mean_s == 0.02
    watch.begin()
    time.sleep(0.08)  # past the floor, within 10 x the mean of 0.02
    assert watch.check() is None
    time.sleep(0.15)
    assert watch.check() is not None
    slow = StepWatch(timeout_s=0.01, factor=2, alpha=0.5)
    slow.end(1.0)
    slow.end(3.0)
    assert slow.mean_s == 2.0


def test_a_process_is_loading_until_its_workers_are_set():
    class Worker:
        def __init__(self, live: str | None, ready: str | None) -> None:
            self._live, self._ready = live, ready

        def live(self) -> str | None:
            return self._live

        def ready(self) -> str | None:
            return self._ready

    probes = WorkerProbes(lambda: None)
    assert probes.live() == probes.ready() == "loading the model"
    probes.services = [Worker(None, None), Worker("wedged", "waiting")]
    assert (probes.live(), probes.ready()) == ("wedged", "waiting")
    probes.loop_check = lambda: "the event loop did not respond within 3 s"
    assert probes.live() == "the event loop did not respond within 3 s"


def test_http_config_is_checked():
    assert WorkerHttpConfig().http_port == 0  # off unless asked for
    with pytest.raises(ValueError, match="http_port"):
        WorkerHttpConfig(http_port=70000)
    with pytest.raises(ValueError, match="execute_model_timeout"):
        WorkerHttpConfig(execute_model_timeout=0)
    with pytest.raises(ValueError, match="factor"):
        WorkerHttpConfig(execute_model_timeout_factor=0.5)


@pytest.fixture
def model_dir(tmp_path):
    return write_model_config(tmp_path, vocab_size=50)


def test_ready_once_adopted_and_a_goodbye_on_leaving(model_dir, nats_url):
    async def run() -> None:
        runner = SimRunner(
            RunnerConfig(model_dir=str(model_dir), block_size=4, num_blocks=64), SimConfig()
        )
        service = WorkerService(WorkerServiceConfig(nats_url=nats_url, worker_id="w-3"), runner)
        nc = await bus.connect(nats_url, "test")
        subjects = Subjects()
        results: asyncio.Queue[ModelRunnerOutput] = asyncio.Queue()
        goodbyes: asyncio.Queue[WorkerGoodbye] = asyncio.Queue()
        hellos: asyncio.Queue[WorkerHello] = asyncio.Queue()
        await bus.subscribe(nc, subjects.worker_hello("*"), WorkerHello, hellos.put)
        await bus.subscribe(nc, subjects.result("*"), ModelRunnerOutput, results.put)
        await bus.subscribe(nc, subjects.worker_goodbye("*"), WorkerGoodbye, goodbyes.put)
        await bus.flush(nc)
        await service.start()
        await asyncio.wait_for(hellos.get(), 5)  # after its subscription to its plans
        assert service.live() is None
        assert service.ready() == "waiting for a scheduler to adopt it"
        # the scheduler's adoption: an empty plan of its session
        await bus.publish(
            nc, subjects.plan("w-3"), BatchPlan(step_id=0, scheduler_epoch="e", worker_session="s")
        )
        await asyncio.wait_for(results.get(), 5)
        assert service.ready() is None
        new = NewRequestData(
            req_id="a",
            prompt_token_ids=[10, 11, 12, 13, 14],
            sampling_params=SamplingParams(),
            block_ids=[0, 1],
            num_computed_tokens=0,
        )
        step = BatchPlan(
            step_id=1,
            new_reqs=[new],
            num_scheduled_tokens={"a": 5},
            total_num_scheduled_tokens=5,
            scheduler_epoch="e",
            worker_session="s",
        )
        await bus.publish(nc, subjects.plan("w-3"), step)
        await asyncio.wait_for(results.get(), 5)
        registry = service.metrics.registry
        wid = {"worker_id": "w-3"}
        assert registry.get_sample_value("skiff_worker_step_seconds_count", wid) == 1  # not empty
        assert registry.get_sample_value("skiff_worker_batch_size_sum", wid) == 1
        tokens = registry.get_sample_value(
            "vllm:iteration_tokens_total_sum",
            {"model_name": service.config.served_model_name, **wid},
        )
        assert tokens == 5
        assert service.watch.mean_s is not None and service.watch.check() is None

        instance = service.instance_id
        await service.leave()
        goodbye = await asyncio.wait_for(goodbyes.get(), 5)
        assert (goodbye.worker_id, goodbye.instance_id) == ("w-3", instance)
        assert service.ready() == "leaving"
        await nc.drain()

    asyncio.run(run())


def test_a_long_step_that_makes_progress_is_not_wedged():
    watch = StepWatch(timeout_s=0.05, factor=1)
    watch.begin()
    for layers_done in range(1, 6):  # 0.15 s in all, a layer every 0.03 s
        time.sleep(0.03)
        assert watch.check(progress=layers_done) is None
    time.sleep(0.08)  # then no layer for longer than the floor
    assert "no progress" in (watch.check(progress=5) or "")
