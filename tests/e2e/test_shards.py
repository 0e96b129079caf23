"""Scheduling scaled out: two scheduler shards, each owning every other simulated worker, behind
one gateway. Requests spread over both shards; killing one shard's scheduler moves only its own
requests, and every stream still ends with exactly the tokens an undisturbed run gives."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
import urllib.request

import pytest
from openai import AsyncOpenAI

from services.worker.config import SimConfig
from shared.config import DEFAULT_SUBJECT_PREFIX
from shared.subjects import shard_prefixes
from tests.e2e.stats import scheduler_stats
from tests.e2e.test_sim_worker import MODEL, PROMPT, expected_tokens

NUM_SHARDS, NUM_WORKERS = 2, 4
SIM = SimConfig(sim_step_base_ms=5.0, sim_per_token_us=1.0, sim_per_req_us=1.0, sim_eos_rate=0.3)


@pytest.fixture(scope="module")
def sharded(launch_stack):
    s = launch_stack(
        "sharded",
        device="sim",
        workers=NUM_WORKERS,
        scheduler_shards=NUM_SHARDS,
        sim=SIM,
    )
    yield s
    s.stop()


def shard_stats(stack) -> list[dict]:
    return [scheduler_stats(stack, p) for p in shard_prefixes(DEFAULT_SUBJECT_PREFIX, NUM_SHARDS)]


def wait_for_workers(stack) -> list[dict]:
    """Every worker is on its shard, and the gateway has heard so from each shard's heartbeat
    (until then it routes every request to the shards it knows to be ready)."""
    deadline = time.monotonic() + 30
    while True:
        stats = shard_stats(stack)
        gateway_view = [
            gateway_counter(
                stack, "skiff_gateway_shard_ready_workers", f'{{model_name="{MODEL}",shard="{i}"}}'
            )
            for i in range(NUM_SHARDS)
        ]
        if sum(len(s["workers"]) for s in stats) == NUM_WORKERS == sum(gateway_view):
            return stats
        assert time.monotonic() < deadline, (stats, gateway_view)
        time.sleep(0.2)


def gateway_counter(stack, name: str, labels: str = f'{{model_name="{MODEL}"}}') -> float:
    with urllib.request.urlopen(f"{stack.url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    assert match, name + labels
    return float(match.group(1))


async def stream_tokens(client: AsyncOpenAI, seed: int, max_tokens: int) -> tuple[list, str]:
    stream = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=max_tokens,
        seed=seed,
        logprobs=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    tokens, finish = [], None
    async for chunk in stream:
        for c in chunk.choices:
            tokens += c.logprobs.tokens if c.logprobs else []
            finish = c.finish_reason or finish
    return tokens, finish


def test_each_shard_owns_every_other_worker(sharded):
    stats = wait_for_workers(sharded)
    assert [sorted(s["workers"]) for s in stats] == [
        ["worker-0", "worker-2"],
        ["worker-1", "worker-3"],
    ]
    assert list(sharded.procs) == ["nats", "scheduler-0", "scheduler-1", "sim-workers", "gateway"]


def test_a_shard_restart_moves_only_its_own_requests(sharded, smollm2_dir):
    from services.worker.model_config import ModelConfig
    from shared.tokenizer import Tokenizer

    wait_for_workers(sharded)
    info, tokenizer = ModelConfig.from_dir(smollm2_dir), Tokenizer(smollm2_dir)
    seeds, max_tokens = list(range(500, 516)), 200
    migrated_before = gateway_counter(sharded, "skiff_gateway_engine_migrated_total")
    placed: list[int] = []  # requests each shard held when shard 1 was killed

    def restart_shard_1() -> None:
        deadline = time.monotonic() + 20
        while sum(held := [s["num_requests"] for s in shard_stats(sharded)]) < len(seeds):
            assert time.monotonic() < deadline, held
            time.sleep(0.05)
        placed.extend(held)
        sharded.kill("scheduler-1", signal.SIGKILL)
        sharded.start_scheduler(1)

    async def run() -> list[tuple[list, str]]:
        client = AsyncOpenAI(base_url=f"{sharded.url}/v1", api_key="x", max_retries=0)
        disruptor = threading.Thread(target=restart_shard_1)
        try:
            streams = [stream_tokens(client, seed, max_tokens) for seed in seeds]
            disruptor.start()
            return await asyncio.gather(*streams)
        finally:
            disruptor.join()
            await client.close()

    results = asyncio.run(run())
    for seed, (tokens, finish) in zip(seeds, results, strict=True):
        expected = expected_tokens(info, seed, len(PROMPT), max_tokens)
        assert finish == "length"
        assert tokens == tokenizer.token_strs(expected), f"seed {seed}"
    migrated = gateway_counter(sharded, "skiff_gateway_engine_migrated_total") - migrated_before
    assert 0 < placed[1] < len(seeds)  # both shards held requests
    assert migrated == placed[1]  # shard 0's requests stayed where they were
