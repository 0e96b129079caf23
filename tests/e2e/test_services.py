"""Scheduler and workers as real processes over a real nats-server, driven through NATS:
a worker that dies loses its KV cache, not its requests."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from bench.workload import token_prompts
from services.gateway.config import GatewayConfig
from services.launcher import Stack, StackConfig
from services.scheduler.config import SchedulerServiceConfig
from services.worker.config import RunnerConfig
from shared import bus
from shared.config import SchedulerConfig
from shared.subjects import Subjects
from shared.tokenizer import Tokenizer
from shared.wire import (
    OutputBatch,
    SamplingParams,
    SchedulerStats,
    SchedulerStatsRequest,
    SubmitReply,
    SubmitRequest,
)

NEW_TOKENS = 40


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def two_worker_stack(request, smollm2_dir, tmp_path_factory):
    stack = Stack(
        StackConfig(
            RunnerConfig(str(smollm2_dir), kv_cache_gib=0.25),
            GatewayConfig(served_model_name="smol"),
            workers=2,
            scheduler=SchedulerConfig(async_scheduling=request.param),
            # the test's client submits as a gateway but sends no heartbeats: without a long
            # gateway timeout its requests are aborted as orphans if migration takes 15 s
            scheduler_service=SchedulerServiceConfig(worker_timeout=2.0, gateway_timeout=600.0),
            log_dir=str(tmp_path_factory.mktemp("logs")),
        )
    )
    stack.start_nats()
    stack.start_scheduler()
    stack.start_worker(0)
    stack.start_worker(1)
    yield stack
    stack.stop()


async def _stats(nc) -> dict:
    stats = await bus.request(
        nc, Subjects().scheduler_stats, SchedulerStatsRequest(), SchedulerStats, 5
    )
    return msgspec.to_builtins(stats)


async def _wait_workers(nc, n: int) -> None:
    for _ in range(240):
        try:
            if len((await _stats(nc))["workers"]) >= n:
                return
        except Exception:  # scheduler not up yet
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError("workers did not register")


def test_worker_death_migrates_requests(two_worker_stack, smollm2_dir):
    from services.offline import LLM

    prompts = token_prompts(Tokenizer(smollm2_dir), [20, 45, 70, 95, 120, 33], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    reference = [
        o.outputs[0].token_ids for o in LLM(smollm2_dir, kv_cache_gib=0.1).generate(prompts, params)
    ]

    async def run():
        nc = await bus.connect(
            two_worker_stack.nats_url, "test-client", **two_worker_stack.nats_options()
        )
        await _wait_workers(nc, 2)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        finished: dict[str, str] = {}
        all_done = asyncio.Event()

        async def on_output(batch: OutputBatch) -> None:
            for d in batch.deltas:
                tokens[d.req_id].extend(d.new_token_ids)
                if d.finish_reason:
                    finished[d.req_id] = d.finish_reason
            if len(finished) == len(prompts):
                all_done.set()

        await bus.subscribe(nc, Subjects().output("gw-test"), OutputBatch, on_output)
        for i, p in enumerate(prompts):
            submit = SubmitRequest(
                req_id=f"r{i}", gateway_id="gw-test", prompt_token_ids=p, sampling_params=params
            )
            reply = await bus.request(nc, Subjects().submit, submit, SubmitReply, 5)
            assert reply.accepted
        while min(len(t) for t in tokens.values()) < 5:
            await asyncio.sleep(0.05)
        before = await _stats(nc)
        assert before["workers"]["worker-0"]["num_running"] > 0
        two_worker_stack.kill("worker-0")
        await asyncio.wait_for(all_done.wait(), 240)
        after = await _stats(nc)
        await nc.drain()
        return tokens, finished, after

    tokens, finished, after = asyncio.run(run())
    assert set(after["workers"]) == {"worker-1"}
    assert (
        after["workers"]["worker-1"]["num_free_blocks"]
        == after["workers"]["worker-1"]["num_blocks"]
    )
    assert all(reason == "length" for reason in finished.values())
    for i, ref in enumerate(reference):
        assert tokens[f"r{i}"] == ref, f"request {i} differs after migration"
