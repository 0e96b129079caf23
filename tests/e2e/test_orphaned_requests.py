"""A gateway that dies with streams in flight: the scheduler stops hearing its heartbeats and
aborts its requests within `--gateway-timeout`, freeing their workers; a gateway started again
serves at once."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from openai import AsyncOpenAI, OpenAI

from services.scheduler.config import SchedulerServiceConfig
from services.worker.config import SimConfig
from tests.e2e.stats import scheduler_stats
from tests.e2e.test_shards import stream_tokens
from tests.e2e.test_sim_worker import MODEL, PROMPT, expected_tokens

SIM = SimConfig(sim_step_base_ms=20.0, sim_per_token_us=1.0, sim_per_req_us=1.0, sim_eos_rate=0.3)
GATEWAY_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def orphan_stack(launch_stack):
    s = launch_stack(
        "orphans",
        device="sim",
        workers=2,
        sim=SIM,
        scheduler_service=SchedulerServiceConfig(gateway_timeout=GATEWAY_TIMEOUT_S),
    )
    yield s
    s.stop()


def test_a_dead_gateways_requests_are_aborted_and_a_new_gateway_serves(orphan_stack, smollm2_dir):
    from services.worker.model_config import ModelConfig
    from shared.tokenizer import Tokenizer

    stack, num_streams = orphan_stack, 6
    aborted_before = scheduler_stats(stack)["num_orphans_aborted"]

    async def streams_then_kill() -> float:
        client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=60)
        # 1500 tokens at 20 ms a step: far longer than the test, unless aborted
        streams = [
            asyncio.create_task(stream_tokens(client, seed, 1500)) for seed in range(num_streams)
        ]
        deadline = time.monotonic() + 30
        while (await asyncio.to_thread(scheduler_stats, stack))["num_requests"] < num_streams:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        await asyncio.to_thread(stack.kill, "gateway", signal.SIGKILL)
        killed_at = time.monotonic()
        results = await asyncio.gather(*streams, return_exceptions=True)
        assert all(isinstance(r, Exception) for r in results)  # their client is gone too
        await client.close()
        return killed_at

    killed_at = asyncio.run(streams_then_kill())
    while (stats := scheduler_stats(stack))["num_requests"]:
        # the timeout, one scheduler heartbeat and the gateway's last beat take ~4.5 s; 10 s of
        # slack for a loaded machine is still far below the streams' own 30 s (1500 x 20 ms)
        assert time.monotonic() - killed_at < GATEWAY_TIMEOUT_S + 10, stats
        time.sleep(0.1)
    assert time.monotonic() - killed_at > GATEWAY_TIMEOUT_S - 1.5  # not before the timeout
    assert stats["num_orphans_aborted"] - aborted_before == num_streams
    assert all(
        not w["statuses"] and w["num_free_blocks"] == w["num_blocks"]
        for w in stats["workers"].values()
    )

    stack.start_gateway()
    stack.wait_ready(60)
    info, tokenizer = ModelConfig.from_dir(smollm2_dir), Tokenizer(smollm2_dir)
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=60)
    got = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        seed=5,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].logprobs.tokens == tokenizer.token_strs(
        expected_tokens(info, 5, len(PROMPT), 12)
    )


def test_a_gateway_that_never_sent_a_heartbeat_still_has_its_requests_aborted(orphan_stack):
    """A gateway that dies before its first heartbeat reached the scheduler (here: a client
    that submits on NATS and never beats): its submissions were its signs of life, so its
    requests are aborted after the gateway timeout, not left to run to max_tokens."""
    from shared import bus
    from shared.sampling_params import SamplingParams
    from shared.subjects import Subjects
    from shared.wire import SubmitReply, SubmitRequest

    stack = orphan_stack
    aborted_before = scheduler_stats(stack)["num_orphans_aborted"]
    params = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)

    async def submit() -> float:
        nc = await bus.connect(stack.nats_url, "ghost-gateway", **stack.nats_options())
        request = SubmitRequest(
            req_id="ghost-1", gateway_id="ghost", prompt_token_ids=[1, 2, 3], sampling_params=params
        )
        reply = await bus.request(nc, Subjects().submit, request, SubmitReply, 5)
        assert reply.accepted
        await nc.close()
        return time.monotonic()

    submitted_at = asyncio.run(submit())
    while scheduler_stats(stack)["num_orphans_aborted"] == aborted_before:
        assert time.monotonic() - submitted_at < GATEWAY_TIMEOUT_S + 10
        time.sleep(0.1)
    assert time.monotonic() - submitted_at > GATEWAY_TIMEOUT_S - 1.5
    assert scheduler_stats(stack)["num_orphans_aborted"] - aborted_before == 1
