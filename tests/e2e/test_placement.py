"""Placement of bursts on a real stack with two simulated workers: requests that arrive
together spread over both workers, and requests sharing a prefix still find it cached.

Which worker took a request is read from the scheduler's per-worker prefix-cache counters:
every admitted prompt is looked up there once, so the lookups per worker count the prompt
tokens each one received."""

from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI

from services.worker.config import SimConfig
from shared.config import DEFAULT_BLOCK_SIZE
from tests.e2e.stats import scheduler_stats

MODEL = "SmolLM2-135M-Instruct"
BURST = 16
PROMPT_LEN = 64


@pytest.fixture(scope="module")
def two_workers(launch_stack):
    sim = SimConfig(sim_step_base_ms=5.0, sim_per_token_us=20.0, sim_per_req_us=20.0)
    s = launch_stack("placement-stack", device="sim", workers=2, sim=sim)
    yield s
    s.stop()


def lookups(stack) -> dict[str, tuple[int, int]]:
    """(prompt tokens looked up, of which cached) per worker."""
    workers = scheduler_stats(stack)["workers"]
    return {w: (s["prefix_cache_queries"], s["prefix_cache_hits"]) for w, s in workers.items()}


def burst(stack, prompts: list[list[int]]) -> None:
    async def run() -> None:
        client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
        async with client:
            completions = await asyncio.gather(
                *(
                    client.completions.create(model=MODEL, prompt=p, max_tokens=8, seed=i)
                    for i, p in enumerate(prompts)
                )
            )
        assert all(c.choices[0].text is not None for c in completions)

    asyncio.run(run())


def delta(before: dict, after: dict) -> dict[str, tuple[int, int]]:
    return {
        w: (q - before.get(w, (0, 0))[0], h - before.get(w, (0, 0))[1])
        for w, (q, h) in after.items()
    }


def test_a_burst_of_distinct_prompts_uses_both_workers(two_workers):
    prompts = [[1000 + 97 * i + j for j in range(PROMPT_LEN)] for i in range(BURST)]
    before = lookups(two_workers)
    burst(two_workers, prompts)
    received = {w: q // PROMPT_LEN for w, (q, _) in delta(before, lookups(two_workers)).items()}
    assert sorted(received) == ["worker-0", "worker-1"], received
    assert sum(received.values()) == BURST, received
    # Equal prompts on equal workers: neither may take more than three quarters of the burst.
    assert max(received.values()) <= BURST * 3 // 4, received


def test_a_shared_prefix_burst_hits_the_prefix_cache(two_workers):
    prefix = [2000 + j for j in range(8 * DEFAULT_BLOCK_SIZE)]
    burst(two_workers, [[*prefix, 50]])  # the prefix is cached on one worker now
    before = lookups(two_workers)
    burst(two_workers, [prefix + [60 + i] * DEFAULT_BLOCK_SIZE for i in range(BURST)])
    hits = sum(h for _, h in delta(before, lookups(two_workers)).values())
    # At least half of the burst found the whole prefix cached where it was placed.
    assert hits >= BURST // 2 * len(prefix), hits
