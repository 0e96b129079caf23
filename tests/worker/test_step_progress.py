"""Progress during a step: the model counts its decoder layers and logits passes, and the
worker's heartbeats, sent from its event loop while a step runs, carry the step's id and that
count as it advances (what tells the scheduler a long step from a hung worker)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from services.worker.config import RunnerConfig, SimConfig, WorkerServiceConfig
from services.worker.model_runner import ModelRunner
from services.worker.service import WorkerService
from services.worker.sim_runner import SimRunner
from shared import bus
from shared.subjects import Subjects
from shared.wire import BatchPlan, ModelRunnerOutput, WorkerHello
from tests.worker.test_cpu_decode import decode_meta
from tests.worker.test_sim_runner import BS, new, plan, write_model_config

STEP_S = 1.0
BEAT_S = 0.1
LAYERS = 10  # one every 0.1 s of the step


@pytest.fixture
def model_dir(tmp_path):
    return write_model_config(tmp_path, vocab_size=50, num_hidden_layers=LAYERS)


@torch.inference_mode()
def test_the_model_counts_its_layers_and_logits_on_every_path(tiny_models):
    runner = ModelRunner(
        RunnerConfig(model_dir=str(tiny_models["llama"]), num_blocks=64, max_model_len=256)
    )
    layers = runner.model_config.num_hidden_layers
    assert runner.fused_cpu_decode is not None
    meta = decode_meta(torch.tensor([[3, 4]], dtype=torch.int32), [20])
    input_ids, positions = torch.tensor([5]), torch.tensor([19])
    start = runner.progress
    hidden = runner.model(input_ids, positions, runner.kv_caches, meta)
    assert runner.progress == start + layers
    runner.fused_cpu_decode.forward(input_ids, positions, decode_meta(meta.block_table, [20]))
    assert runner.progress == start + 2 * layers
    runner.model.compute_logits(hidden)
    assert runner.progress == start + 2 * layers + 1


class ThreadedSim:
    """A blocking runner (run on the service's executor thread, as ModelRunner is): a
    SimRunner's step, held by sleeping through its layers one by one."""

    def __init__(self, sim: SimRunner) -> None:
        self.sim = sim
        self.config, self.num_blocks = sim.config, sim.num_blocks
        self.max_model_len, self.device = sim.max_model_len, sim.device
        self.model_config, self.timer, self.batch = sim.model_config, sim.timer, sim.batch
        self.kv_tiers = sim.kv_tiers
        self.progress = 0

    def execute(self, plan: BatchPlan) -> ModelRunnerOutput:
        layers = self.model_config.num_hidden_layers
        for _ in range(layers):
            time.sleep(self.sim.step_time_s(plan) / layers)
            self.progress += 1
        return self.sim.execute(plan)

    def reset(self) -> None:
        self.sim.reset()
        self.batch = self.sim.batch


def heartbeats_during_a_long_step(nats_url: str, runner: SimRunner | ThreadedSim) -> list:
    """(step_id, progress) of the heartbeats sent while one step of STEP_S ran, and of the
    first one after it."""

    async def run() -> list[tuple[int, int]]:
        config = WorkerServiceConfig(nats_url=nats_url, worker_id="w-p", heartbeat_interval=BEAT_S)
        service = WorkerService(config, runner)
        nc = await bus.connect(nats_url, "test")
        subjects = Subjects()
        beats: asyncio.Queue[WorkerHello] = asyncio.Queue()
        results: asyncio.Queue[ModelRunnerOutput] = asyncio.Queue()
        await bus.subscribe(nc, subjects.worker_heartbeat("*"), WorkerHello, beats.put)
        await bus.subscribe(nc, subjects.result("*"), ModelRunnerOutput, results.put)
        hellos: asyncio.Queue[WorkerHello] = asyncio.Queue()
        await bus.subscribe(nc, subjects.worker_hello("*"), WorkerHello, hellos.put)
        await bus.flush(nc)
        await service.start()
        # its hello follows its subscriptions on its connection: the plan below reaches it
        await asyncio.wait_for(hellos.get(), 10)
        step = plan(7, {"a": 3}, new_reqs=[new("a", 3, [0])], worker_session="s")
        await bus.publish(nc, subjects.plan("w-p"), step)
        await asyncio.wait_for(results.get(), 10)
        seen = []
        while not beats.empty():
            beat = beats.get_nowait()
            seen.append((beat.step_id, beat.progress))
        after = await asyncio.wait_for(beats.get(), 5)
        await service.stop()
        await nc.drain()
        return [*seen, (after.step_id, after.progress)]

    return asyncio.run(run())


def sim_runner(model_dir) -> SimRunner:
    sim = SimConfig(sim_step_base_ms=STEP_S * 1000)
    return SimRunner(RunnerConfig(model_dir=str(model_dir), block_size=BS, num_blocks=64), sim)


def check_progress(beats: list[tuple[int, int]]) -> None:
    during = [progress for step_id, progress in beats[:-1] if step_id == 7]
    assert len(during) >= 5  # ~STEP_S / BEAT_S heartbeats while the step ran
    assert during == sorted(during) and len(set(during)) >= 4  # it advances
    assert beats[-1] == (-1, LAYERS)  # done: no step running, every layer counted


def test_heartbeats_carry_progress_during_a_step_on_the_runner_thread(model_dir, nats_url):
    check_progress(heartbeats_during_a_long_step(nats_url, ThreadedSim(sim_runner(model_dir))))


def test_heartbeats_carry_progress_during_a_simulated_step(model_dir, nats_url):
    check_progress(heartbeats_during_a_long_step(nats_url, sim_runner(model_dir)))
