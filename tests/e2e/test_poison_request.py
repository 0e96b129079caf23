"""A request that hangs every worker running it ends with an error instead of taking down
worker after worker, and the other streams go on: the poison request's worker is stopped
(SIGSTOP, heartbeats replayed) each time it runs it. At its second stalled worker it fails
with a 422 error event; the stream that shared that worker moves on and ends exactly as an
undisturbed run. Two simulated workers, each in a process of its own."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import urllib.request

import openai
import pytest
from openai import AsyncOpenAI

from services.gateway.config import GatewayConfig
from services.launcher import Stack, StackConfig, free_port
from services.scheduler.config import SchedulerServiceConfig
from services.worker.config import RunnerConfig
from shared.config import SchedulerConfig
from tests.e2e.stats import scheduler_stats
from tests.e2e.test_hung_worker import SIM, HeartbeatReplay
from tests.e2e.test_shards import MODEL, stream_tokens
from tests.e2e.test_sim_worker import PROMPT, expected_tokens
from tests.e2e.worker_processes import start_with_worker_processes

STEP_TIMEOUT_S = 2.0
POISON_PROMPT = PROMPT[::-1]  # shares no cached block with PROMPT


@pytest.fixture(scope="module")
def stack(smollm2_dir, tmp_path_factory):
    """nats, scheduler (with /metrics), worker-0 and worker-1 in processes of their own,
    gateway."""
    service = SchedulerServiceConfig(
        step_timeout=STEP_TIMEOUT_S, step_timeout_per_token=0.001, metrics_port=free_port()
    )
    stack = start_with_worker_processes(
        StackConfig(
            RunnerConfig(str(smollm2_dir), device="sim"),
            GatewayConfig(served_model_name=MODEL, port=free_port()),
            workers=2,
            sim=SIM,
            scheduler=SchedulerConfig(max_model_len=2048),
            scheduler_service=service,
            log_dir=str(tmp_path_factory.mktemp("poison-request-logs")),
        )
    )
    yield stack
    stack.stop()


def holder(stack: Stack, req_id: str) -> str | None:
    """The worker running `req_id` (an engine id)."""
    for worker_id, worker in scheduler_stats(stack)["workers"].items():
        if worker["statuses"].get(req_id) == "running":
            return worker_id
    return None


def running(stack: Stack) -> dict[str, str]:
    """Engine id -> worker, of the running requests."""
    workers = scheduler_stats(stack)["workers"].items()
    return {r: wid for wid, w in workers for r, s in w["statuses"].items() if s == "running"}


def requests_failed(stack: Stack) -> float:
    port = stack.config.scheduler_service.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    match = re.search(r"^skiff_requests_failed_total (\S+)$", text, re.MULTILINE)
    assert match, "no skiff_requests_failed_total"
    return float(match.group(1))


def ids_on(stack: Stack, worker_id: str) -> set[str]:
    return set(scheduler_stats(stack)["workers"][worker_id]["statuses"])


async def wait_for(predicate, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (value := await asyncio.to_thread(predicate)):
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)
    return value


async def poison_stream(client: AsyncOpenAI) -> openai.APIError:
    """Stream the poison request until its error event; returns the error."""
    stream = await client.completions.create(
        model=MODEL,
        prompt=POISON_PROMPT,
        max_tokens=1500,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    try:
        async for _ in stream:
            pass
    except openai.APIError as e:
        return e
    raise AssertionError("the poison request finished without an error")


def test_a_request_that_hangs_its_workers_fails_and_the_others_stream_on(stack, smollm2_dir):
    from services.worker.model_config import ModelConfig
    from shared.tokenizer import Tokenizer

    info, tokenizer = ModelConfig.from_dir(smollm2_dir), Tokenizer(smollm2_dir)
    seed, max_tokens = 900, 500
    pids = {wid: stack.procs[wid].pid for wid in ("worker-0", "worker-1")}
    failed_before = requests_failed(stack)

    async def hang(worker_id: str, until) -> None:
        """Stop `worker_id` (its heartbeats replayed) until `until()` holds, then resume it."""
        async with HeartbeatReplay(stack, worker_id) as replay:
            await replay.start()
            os.kill(pids[worker_id], signal.SIGSTOP)
            try:
                await wait_for(until, f"{worker_id} stopped in vain", 30)
            finally:
                os.kill(pids[worker_id], signal.SIGCONT)

    async def run() -> tuple[tuple[list, str], openai.APIError, set[str]]:
        client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=120)
        good = asyncio.create_task(stream_tokens(client, seed, max_tokens))
        try:
            [(good_id, a)] = (await wait_for(lambda: running(stack), "no stream placed")).items()
            b = next(w for w in pids if w != a)
            poison = asyncio.create_task(poison_stream(client))
            # on the cheaper worker: the other one holds the good stream's blocks
            on_b = await wait_for(lambda: ids_on(stack, b), "the poison request not placed")
            [poison_id] = on_b
            await wait_for(lambda: holder(stack, poison_id) == b, "the poison request idles")
            # first stall: the poison request moves to `a`, where the good stream runs
            await hang(b, lambda: holder(stack, poison_id) == a)
            await wait_for(lambda: scheduler_stats(stack)["workers"][b]["healthy"], "no probe")
            with_poison = await asyncio.to_thread(ids_on, stack, a)
            # second stall: the poison request fails, the good stream moves back to `b`
            await hang(a, lambda: poison.done() and holder(stack, good_id) == b)
            return await good, await poison, with_poison
        finally:
            for pid in pids.values():
                os.kill(pid, signal.SIGCONT)
            good.cancel()
            await client.close()

    try:
        (tokens, finish), error, with_poison = asyncio.run(run())
    finally:
        for pid in pids.values():
            os.kill(pid, signal.SIGCONT)
    assert len(with_poison) == 2  # the good stream shared the second stalled worker
    assert isinstance(error.body, dict) and error.body["code"] == 422
    assert "stalled or failed" in error.message
    assert finish == "length"
    assert tokens == tokenizer.token_strs(expected_tokens(info, seed, len(PROMPT), max_tokens))
    assert requests_failed(stack) == failed_before + 1
