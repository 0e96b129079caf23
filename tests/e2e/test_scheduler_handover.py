"""A graceful scheduler shutdown hands over: on SIGTERM the scheduler announces that it leaves
and exits at once; its streams move to the scheduler started next and end exactly as an
undisturbed run, and requests sent while no scheduler runs wait for it instead of failing."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from openai import AsyncOpenAI

from services.worker.config import SimConfig
from tests.e2e.stats import scheduler_stats
from tests.e2e.test_shards import stream_tokens
from tests.e2e.test_sim_worker import MODEL, PROMPT, expected_tokens

SIM = SimConfig(sim_step_base_ms=20.0, sim_per_token_us=1.0, sim_per_req_us=1.0, sim_eos_rate=0.3)


@pytest.fixture(scope="module")
def handover_stack(launch_stack):
    s = launch_stack("handover", device="sim", workers=2, sim=SIM)
    yield s
    s.stop()


async def completion_tokens(client: AsyncOpenAI, seed: int, max_tokens: int) -> list[str]:
    got = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=max_tokens,
        seed=seed,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].finish_reason == "length"
    return got.choices[0].logprobs.tokens


def test_sigterm_hands_streams_over_to_the_next_scheduler(handover_stack, smollm2_dir):
    from services.worker.model_config import ModelConfig
    from shared.tokenizer import Tokenizer

    stack = handover_stack
    info, tokenizer = ModelConfig.from_dir(smollm2_dir), Tokenizer(smollm2_dir)
    seeds, gap_seeds, max_tokens = list(range(900, 908)), list(range(950, 954)), 200
    old = stack.procs["scheduler"]
    exit_s: list[float] = []

    async def run() -> tuple[list, list]:
        client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=120)
        try:
            streams = [
                asyncio.create_task(stream_tokens(client, seed, max_tokens)) for seed in seeds
            ]
            deadline = time.monotonic() + 30
            while (await asyncio.to_thread(scheduler_stats, stack))["num_requests"] < len(seeds):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)  # some tokens streamed
            t0 = time.monotonic()
            old.send_signal(signal.SIGTERM)
            gap = [asyncio.create_task(completion_tokens(client, seed, 12)) for seed in gap_seeds]
            await asyncio.to_thread(old.wait, 30)
            exit_s.append(time.monotonic() - t0)
            await asyncio.sleep(1.0)  # no scheduler at all for a while
            await asyncio.to_thread(stack.start_scheduler)
            return await asyncio.gather(*streams), await asyncio.gather(*gap)
        finally:
            await client.close()

    results, gap_results = asyncio.run(run())
    assert old.returncode == 0
    assert exit_s[0] < 5, exit_s  # it hands over, it does not wait for its streams
    for seed, (tokens, finish) in zip(seeds, results, strict=True):
        assert finish == "length"
        expected = expected_tokens(info, seed, len(PROMPT), max_tokens)
        assert tokens == tokenizer.token_strs(expected), f"seed {seed}"
    for seed, tokens in zip(gap_seeds, gap_results, strict=True):
        assert tokens == tokenizer.token_strs(expected_tokens(info, seed, len(PROMPT), 12))
