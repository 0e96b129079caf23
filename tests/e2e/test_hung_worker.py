"""A worker that hangs while it still heart-beats (SIGSTOP, with its heartbeats replayed on
NATS as a hung-but-alive process would send them) misses its step deadline: the scheduler marks
it unhealthy and moves its requests, with their tokens, to the other worker, and every stream
ends exactly as an undisturbed run; after SIGCONT the worker answers a probe and gets requests
again. Two simulated workers, each in a process of its own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
import urllib.request

import pytest
from openai import AsyncOpenAI

from services.gateway.config import GatewayConfig
from services.launcher import Stack, StackConfig, free_port
from services.scheduler.config import SchedulerServiceConfig
from services.worker.config import RunnerConfig, SimConfig
from shared import bus
from shared.config import SchedulerConfig
from shared.subjects import Subjects
from shared.wire import WorkerHello, decoder
from tests.e2e.stats import scheduler_stats
from tests.e2e.test_shards import stream_tokens
from tests.e2e.test_sim_worker import PROMPT, expected_tokens
from tests.e2e.worker_processes import start_with_worker_processes

SIM = SimConfig(sim_step_base_ms=20.0, sim_per_token_us=1.0, sim_per_req_us=1.0, sim_eos_rate=0.3)
STEP_TIMEOUT_S = 3.0
VICTIM = "worker-1"


@pytest.fixture(scope="module")
def two_workers(smollm2_dir, tmp_path_factory):
    """nats, scheduler (with /metrics), worker-0 and worker-1 in processes of their own,
    gateway."""
    logs = tmp_path_factory.mktemp("hung-worker-logs")
    service = SchedulerServiceConfig(
        step_timeout=STEP_TIMEOUT_S, step_timeout_per_token=0.001, metrics_port=free_port()
    )
    stack = start_with_worker_processes(
        StackConfig(
            RunnerConfig(str(smollm2_dir), device="sim"),
            GatewayConfig(served_model_name="SmolLM2-135M-Instruct", port=free_port()),
            workers=2,
            sim=SIM,
            scheduler=SchedulerConfig(max_model_len=2048),
            scheduler_service=service,
            log_dir=str(logs),
        )
    )
    yield stack
    stack.stop()


def scheduler_metric(stack: Stack, name: str, worker_id: str) -> float | None:
    port = stack.config.scheduler_service.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    match = re.search(rf'^{name}{{worker_id="{worker_id}"}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else None


class HeartbeatReplay:
    """Keeps the last heartbeat of one worker and, once `start()`ed, publishes it again every
    half second: what the scheduler hears from a process that hangs but still heart-beats."""

    def __init__(self, stack: Stack, worker_id: str) -> None:
        self.stack, self.worker_id = stack, worker_id
        self.last: bytes | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> HeartbeatReplay:
        self.nc = await bus.connect(
            self.stack.nats_url, "test-heartbeat-replay", **self.stack.nats_options()
        )
        subject = Subjects().worker_heartbeat(self.worker_id)
        typed = decoder(WorkerHello)

        async def keep(msg) -> None:
            if typed.decode(msg.data).worker_id == self.worker_id:
                self.last = msg.data

        await self.nc.subscribe(subject, cb=keep)
        return self

    async def start(self) -> None:
        deadline = time.monotonic() + 10
        while self.last is None:
            assert time.monotonic() < deadline, "no heartbeat seen"
            await asyncio.sleep(0.1)
        self._task = asyncio.create_task(self._replay(self.last))

    async def _replay(self, payload: bytes) -> None:
        while True:
            await self.nc.publish(Subjects().worker_heartbeat(self.worker_id), payload)
            await asyncio.sleep(0.5)

    async def __aexit__(self, *_exc) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.nc.drain()


def victim_statuses(stack: Stack) -> dict[str, str]:
    return scheduler_stats(stack)["workers"][VICTIM]["statuses"]


def test_a_hung_worker_loses_its_streams_to_the_other_and_comes_back(two_workers, smollm2_dir):
    from services.worker.model_config import ModelConfig
    from shared.tokenizer import Tokenizer

    stack = two_workers
    info, tokenizer = ModelConfig.from_dir(smollm2_dir), Tokenizer(smollm2_dir)
    seeds, max_tokens = list(range(700, 708)), 250
    victim = stack.procs[VICTIM]
    timeouts_before = scheduler_metric(stack, "skiff_worker_step_timeouts_total", VICTIM) or 0
    stopped_with: dict[str, str] = {}

    async def run() -> list[tuple[list, str]]:
        client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=120)
        async with HeartbeatReplay(stack, VICTIM) as replay:
            streams = [
                asyncio.create_task(stream_tokens(client, seed, max_tokens)) for seed in seeds
            ]
            try:
                deadline = time.monotonic() + 30
                while not (held := await asyncio.to_thread(victim_statuses, stack)):
                    assert time.monotonic() < deadline, "the victim got no request"
                    await asyncio.sleep(0.1)
                await asyncio.sleep(0.5)  # some tokens streamed
                await replay.start()
                os.kill(victim.pid, signal.SIGSTOP)
                stopped_with.update(held)
                results = await asyncio.gather(*streams)
                while_stopped = (await asyncio.to_thread(scheduler_stats, stack))["workers"]
                assert not while_stopped[VICTIM]["healthy"]  # not dropped: it heart-beats
                assert while_stopped[VICTIM]["statuses"] == {}
                return results
            finally:
                os.kill(victim.pid, signal.SIGCONT)  # on failure too
                for task in streams:
                    task.cancel()
                await client.close()

    try:
        results = asyncio.run(run())
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    assert stopped_with, "the victim held no request when it was stopped"
    for seed, (tokens, finish) in zip(seeds, results, strict=True):
        expected = expected_tokens(info, seed, len(PROMPT), max_tokens)
        assert finish == "length"
        assert tokens == tokenizer.token_strs(expected), f"seed {seed}"
    timeouts = scheduler_metric(stack, "skiff_worker_step_timeouts_total", VICTIM)
    assert timeouts is not None and timeouts > timeouts_before

    # SIGCONT above: the worker catches up, answers a probe and is healthy again
    deadline = time.monotonic() + 30
    while not scheduler_stats(stack)["workers"][VICTIM]["healthy"]:
        assert time.monotonic() < deadline, "the worker never came back"
        time.sleep(0.2)
    assert scheduler_metric(stack, "skiff_worker_healthy", VICTIM) == 1
    steps_before = scheduler_metric(stack, "skiff_worker_execute_seconds_count", VICTIM) or 0

    async def more() -> list[tuple[list, str]]:
        client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=60)
        try:
            return await asyncio.gather(*(stream_tokens(client, s, 20) for s in range(8)))
        finally:
            await client.close()

    for seed, (tokens, finish) in enumerate(asyncio.run(more())):
        assert finish == "length"
        assert tokens == tokenizer.token_strs(expected_tokens(info, seed, len(PROMPT), 20))
    steps = scheduler_metric(stack, "skiff_worker_execute_seconds_count", VICTIM)
    assert steps is not None and steps > steps_before  # it served some of them
