"""A worker told to stop (SIGTERM, as Kubernetes does) says goodbye: the scheduler moves its
requests to the other worker at once, well within the heartbeat timeout, every stream ends
exactly as an undisturbed run, and the worker exits 0. Before that, each worker answers its
probes: ready once adopted, live, with step metrics. Real processes: nats-server (with its
per-service users), scheduler, two simulated workers each in a process of its own, gateway,
through the official `openai` client."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from services.gateway.config import GatewayConfig
from services.launcher import Stack, StackConfig, free_port
from services.scheduler.config import SchedulerServiceConfig
from services.worker.config import RunnerConfig, SimConfig
from shared import bus
from shared.config import SchedulerConfig
from shared.subjects import Subjects
from shared.wire import SchedulerStats, SchedulerStatsRequest
from tests.e2e.test_shards import stream_tokens
from tests.e2e.test_sim_worker import PROMPT, expected_tokens
from tests.e2e.worker_processes import start_with_worker_processes

SIM = SimConfig(sim_step_base_ms=20.0, sim_per_token_us=1.0, sim_per_req_us=1.0, sim_eos_rate=0.3)
WORKER_TIMEOUT_S = 5.0  # the scheduler's heartbeat timeout (its default)
MOVE_BOUND_S = 1.0
VICTIM, SURVIVOR = "worker-1", "worker-0"


def free_port_pair() -> int:
    """A port p with p + 1 free too (workers 0 and 1 listen on base + i)."""
    for _ in range(50):
        port = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def two_workers(smollm2_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("goodbye-logs")
    service = SchedulerServiceConfig(worker_timeout=WORKER_TIMEOUT_S)
    stack = start_with_worker_processes(
        StackConfig(
            RunnerConfig(str(smollm2_dir), device="sim"),
            GatewayConfig(served_model_name="SmolLM2-135M-Instruct", port=free_port()),
            workers=2,
            sim=SIM,
            scheduler=SchedulerConfig(max_model_len=2048),
            scheduler_service=service,
            scheduler_metrics_port=0,
            worker_http_port=free_port_pair(),
            log_dir=str(logs),
        )
    )
    yield stack
    stack.stop()


def get(stack: Stack, index: int, path: str) -> tuple[int, str]:
    url = f"http://127.0.0.1:{stack.config.worker_http_port + index}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_workers_answer_their_probes(two_workers):
    for index in (0, 1):
        deadline = time.monotonic() + 30  # adopted: the scheduler's first (empty) plan
        while get(two_workers, index, "/ready") != (200, "ok\n"):
            assert time.monotonic() < deadline, get(two_workers, index, "/ready")
            time.sleep(0.2)
        assert get(two_workers, index, "/health") == (200, "ok\n")
        status, text = get(two_workers, index, "/metrics")
        assert status == 200 and "skiff_worker_model_load_seconds " in text
        free = r'^skiff_worker_kv_cache_blocks\{state="free",worker_id="[^"]+"\} (\S+)$'
        blocks = re.search(free, text, re.MULTILINE)
        assert blocks is not None and float(blocks.group(1)) > 0
        assert get(two_workers, index, "/nope")[0] == 404


class StatsWatch:
    """Asks the scheduler for its stats every few milliseconds over one connection."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack

    async def __aenter__(self) -> StatsWatch:
        self.nc = await bus.connect(self.stack.nats_url, "test-stats", **self.stack.nats_options())
        return self

    async def stats(self) -> SchedulerStats:
        subject = Subjects().scheduler_stats
        return await bus.request(self.nc, subject, SchedulerStatsRequest(), SchedulerStats, 5)

    async def until(self, moved, timeout_s: float) -> float:
        """Seconds until `moved(stats)` holds."""
        start = time.monotonic()
        while not moved(await self.stats()):
            assert time.monotonic() - start < timeout_s, "the requests did not move"
            await asyncio.sleep(0.005)
        return time.monotonic() - start

    async def __aexit__(self, *_exc) -> None:
        await self.nc.drain()


def test_sigterm_moves_a_workers_streams_at_once(two_workers, smollm2_dir):
    from services.worker.model_config import ModelConfig
    from shared.tokenizer import Tokenizer

    stack = two_workers
    info, tokenizer = ModelConfig.from_dir(smollm2_dir), Tokenizer(smollm2_dir)
    seeds, max_tokens = list(range(900, 908)), 250
    victim = stack.procs[VICTIM]
    held: dict[str, str] = {}
    measured: dict[str, float] = {}

    async def run() -> list[tuple[list, str]]:
        client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=120)
        streams = [asyncio.create_task(stream_tokens(client, s, max_tokens)) for s in seeds]
        try:
            async with StatsWatch(stack) as watch:
                deadline = time.monotonic() + 30
                while not (statuses := (await watch.stats()).workers[VICTIM].statuses):
                    assert time.monotonic() < deadline, "the victim got no request"
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)  # some tokens streamed
                held.update((await watch.stats()).workers[VICTIM].statuses)
                assert held and statuses

                def moved(stats: SchedulerStats) -> bool:
                    on_survivor = stats.workers[SURVIVOR].statuses
                    return VICTIM not in stats.workers and all(r in on_survivor for r in held)

                victim.send_signal(signal.SIGTERM)
                measured["move_s"] = await watch.until(moved, WORKER_TIMEOUT_S)
            return await asyncio.gather(*streams)
        finally:
            for task in streams:
                task.cancel()
            await client.close()

    results = asyncio.run(run())
    print(f"SIGTERM to requests moved: {measured['move_s'] * 1000:.0f} ms")
    assert victim.wait(timeout=30) == 0
    assert measured["move_s"] < MOVE_BOUND_S, measured
    for seed, (tokens, finish) in zip(seeds, results, strict=True):
        expected = expected_tokens(info, seed, len(PROMPT), max_tokens)
        assert finish == "length"
        assert tokens == tokenizer.token_strs(expected), f"seed {seed}"
    log = (Path(str(stack.config.log_dir)) / "scheduler.log").read_text()
    assert f"worker {VICTIM} is leaving" in log
    assert f"worker {VICTIM} missed its heartbeats" not in log
