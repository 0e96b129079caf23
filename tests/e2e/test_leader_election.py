"""Two replicas of the scheduler with `--leader-election`, as the chart runs them with
`scheduler.replicas: 2`, through real processes: nats-server, two schedulers, simulated
workers, the gateway and the official openai client. The Lease is the file backend of
`--leader-election-lock-dir` (tests and development only: no Kubernetes API server here);
the election code on top of it is the one that runs against a coordination.k8s.io Lease.

The standby serves nothing (one scheduler epoch on the heartbeat subject); SIGKILL on the
leader mid-stream: the standby takes over within the lease duration with a new epoch, and
every stream completes exactly as undisturbed."""

from __future__ import annotations

import asyncio
import time

import pytest
from openai import AsyncOpenAI

from services.scheduler.config import SchedulerServiceConfig
from services.worker.config import SimConfig
from shared import bus
from shared.subjects import Subjects
from shared.wire import SchedulerHeartbeat
from tests.e2e.test_shards import stream_tokens
from tests.e2e.test_sim_worker import PROMPT, expected_tokens

LEASE, RENEW, RETRY = 3.0, 2.0, 1.0
SIM = SimConfig(sim_step_base_ms=20.0, sim_per_token_us=1.0, sim_per_req_us=1.0, sim_eos_rate=0.3)


@pytest.fixture(scope="module")
def elected_stack(launch_stack, tmp_path_factory):
    service = SchedulerServiceConfig(
        leader_election=True,
        leader_election_lock_dir=str(tmp_path_factory.mktemp("leases")),
        leader_election_lease_duration=LEASE,
        leader_election_renew_deadline=RENEW,
        leader_election_retry_period=RETRY,
    )
    s = launch_stack("leader-election", device="sim", workers=2, sim=SIM, scheduler_service=service)
    leader = s.procs["scheduler"]  # the first one up takes the Lease; the stack waited for it
    s.start_scheduler()  # the standby: procs["scheduler"] from now on
    yield s, leader
    if leader.poll() is None:
        leader.kill()
        leader.wait()
    s.stop()


class Heartbeats:
    """Every scheduler heartbeat on the subject, with its arrival time."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, str]] = []

    async def on_heartbeat(self, beat: SchedulerHeartbeat) -> None:
        self.seen.append((time.monotonic(), beat.epoch))

    def epochs(self, since: float = 0.0) -> list[str]:
        return sorted({epoch for t, epoch in self.seen if t >= since})


def test_the_standby_takes_over_a_killed_leader_and_every_stream_completes(
    elected_stack, smollm2_dir
):
    from services.worker.model_config import ModelConfig
    from shared.tokenizer import Tokenizer

    stack, leader = elected_stack
    standby = stack.procs["scheduler"]
    info, tokenizer = ModelConfig.from_dir(smollm2_dir), Tokenizer(smollm2_dir)
    seeds, max_tokens = list(range(700, 708)), 300
    beats = Heartbeats()

    async def run() -> tuple[list, float, list[str], list[str]]:
        nc = await bus.connect(stack.nats_url, "test-heartbeats", **stack.nats_options())
        await bus.subscribe(
            nc, Subjects().scheduler_heartbeat, SchedulerHeartbeat, beats.on_heartbeat
        )
        client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=120)
        try:
            await asyncio.sleep(LEASE + 2 * RETRY)  # long enough for a standby to misbehave
            assert standby.poll() is None and leader.poll() is None
            before = beats.epochs()
            streams = [
                asyncio.create_task(stream_tokens(client, seed, max_tokens)) for seed in seeds
            ]
            await asyncio.sleep(1.5)  # every stream has tokens
            killed_at = time.monotonic()
            leader.kill()
            while not (after := beats.epochs(since=killed_at + 0.1)) or after == before:
                assert time.monotonic() - killed_at < LEASE + 2 * RETRY + 5, "no takeover"
                await asyncio.sleep(0.05)
            takeover_s = min(t for t, e in beats.seen if e not in before) - killed_at
            return await asyncio.gather(*streams), takeover_s, before, after
        finally:
            await client.close()
            await nc.drain()

    results, takeover_s, before, after = asyncio.run(run())
    print(f"takeover after SIGKILL: {takeover_s:.2f} s (lease {LEASE:g} s, retry {RETRY:g} s)")
    assert len(before) == 1, before  # the standby published nothing
    assert len(after) == 1 and after[0] > before[0], (before, after)  # a new, newer epoch
    assert LEASE - RETRY - 0.5 <= takeover_s <= LEASE + 2 * RETRY + 3, takeover_s
    assert standby.poll() is None
    for seed, (tokens, finish) in zip(seeds, results, strict=True):
        assert finish == "length"
        expected = expected_tokens(info, seed, len(PROMPT), max_tokens)
        assert tokens == tokenizer.token_strs(expected), f"seed {seed}"
