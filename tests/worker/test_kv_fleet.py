"""Cross-worker prefix reuse as the scheduler plans it, over real runners and real TCP: two
workers of one WorkerPool, each a ModelRunner (the tiny random Llama) behind its own
KV-transfer server. A prefix computed on worker A and asked for on worker B is fetched from A
(its blocks pinned there until B reports the load) and B answers exactly as when it computes
the prompt itself; when A is gone mid-way, B's load fails and B computes the prefix, with the
same answer. A prefill worker's hand-over to a decode worker takes the same path: the answer
is the colocated one, also when the transfer fails its checksum and the prompt is recomputed."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.scheduler.placement import Placement
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler, plan_has_work
from services.scheduler.worker_pool import WorkerHandle, WorkerPool
from services.worker.config import RunnerConfig
from services.worker.kv_transfer import TransferServer
from services.worker.model_runner import ModelRunner
from shared.config import SchedulerConfig
from shared.sampling_params import SamplingParams
from shared.wire import KV_DEVICE, ROLE_DECODE, ROLE_MIXED, ROLE_PREFILL, KVLoad, WorkerHello

BS = 4
PROMPT = [(7 * i + 3) % 200 + 2 for i in range(30)]  # 7 full blocks
ANSWER_TOKENS = 6


class Worker:
    """A runner, its KV-transfer server and its handle in the pool."""

    def __init__(
        self,
        name: str,
        model_dir: Path,
        pool: WorkerPool,
        *,
        role: str = ROLE_MIXED,
        cls: type[TransferServer] = TransferServer,
    ) -> None:
        config = RunnerConfig(
            model_dir=str(model_dir), num_blocks=32, block_size=BS, max_model_len=128
        )
        self.runner = ModelRunner(config, worker_id=name)
        self.instance_id = uuid.uuid4().hex
        self.server = cls(self.runner.kv_tiers.block_source(), self.instance_id)
        self.server.start()
        mc = self.runner.model_config
        hello = WorkerHello(
            worker_id=name,
            instance_id=self.instance_id,
            model="tiny",
            block_size=BS,
            num_blocks=config.num_blocks or 0,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            device="cpu",
            vocab_size=mc.vocab_size,
            eos_token_ids=list(mc.eos_token_ids),
            kv_block_bytes=self.runner.kv_tiers.stats.block_bytes,
            kv_transfer_address=self.server.address,
            role=role,
        )
        self.pool = pool
        self.handle: WorkerHandle = pool.register(hello)[0]
        self.loads: list[KVLoad] = []  # every load its plans carried

    @property
    def core(self) -> Scheduler:
        return self.handle.core

    def answer(self, req_id: str) -> list[int]:
        """Run `req_id` (greedy) to its end on this worker; returns its output tokens."""
        self.core.add_request(
            Request(
                req_id,
                list(PROMPT),
                SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS, ignore_eos=True),
            )
        )
        tokens: list[int] = []
        while self.core.has_unfinished():
            plan = self.core.schedule()
            assert plan_has_work(plan)
            self.loads += plan.kv_loads
            for out in self.core.update(self.runner.execute(plan)):
                tokens += out.new_token_ids
        return tokens

    def close(self) -> None:
        self.server.close()
        self.runner.close()


@pytest.fixture
def workers(tiny_models) -> Iterator[tuple[Worker, Worker]]:
    pool = WorkerPool(SchedulerConfig(max_num_batched_tokens=64, max_model_len=128))
    a = Worker("worker-a", tiny_models["llama"], pool)
    b = Worker("worker-b", tiny_models["llama"], pool)
    yield a, b
    a.close()
    b.close()


def test_a_prefix_computed_on_one_worker_is_fetched_by_another(workers):
    a, b = workers
    reference = b.answer("reference")  # computed on B, then dropped from B's pool
    b.core.kv.pool.cached.clear()
    assert a.answer("on-a") == reference
    served = a.server.bytes_served

    assert b.answer("on-b") == reference
    (load,) = b.loads
    assert load.remote_address == a.server.address
    assert (load.remote_instance_id, load.src_tier) == (a.instance_id, KV_DEVICE)
    assert len(load.block_ids) == (len(PROMPT) - 1) // BS  # every full block but the last token's
    assert a.server.bytes_served - served == len(load.block_ids) * a.core.kv_block_bytes
    assert b.core.make_stats().kv_tier_hits == {"remote": len(load.block_ids) * BS}
    assert all(block.ref_cnt == 0 for block in a.core.kv.pool.blocks)  # A's pins released


def test_a_worker_gone_mid_fetch_costs_recomputation_not_the_answer(workers):
    a, b = workers
    reference = b.answer("reference")
    b.core.kv.pool.cached.clear()
    assert a.answer("on-a") == reference
    a.server.close()  # A's process is gone; the scheduler has not noticed yet

    assert b.answer("on-b") == reference
    assert len(b.loads) == 1  # tried once, failed, then computed
    assert b.runner.kv_tiers.stats.read(b.runner.kv_tiers.stats.load_failures) == {"transfer": 1}
    assert b.core.make_stats().kv_tier_hits == {}


class CorruptingServer(TransferServer):
    """Flips one bit of every block it sends, after its checksum was taken."""

    def _send_block(self, conn: socket.socket, data: memoryview, digest: int) -> None:
        bad = bytearray(data)
        bad[len(bad) // 2] ^= 0x10
        super()._send_block(conn, memoryview(bad), digest)


def hand_over(prefill: Worker, decode: Worker, req_id: str) -> list[int]:
    """Place `req_id` (greedy, PROMPT) on a pool of a prefill and a decode worker and drive
    both until it ends; returns its output tokens."""
    placement = Placement(prefill.pool, lambda _wid: None)
    request = Request(
        req_id,
        list(PROMPT),
        SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS, ignore_eos=True),
    )
    placement.place(request)
    assert placement.worker_of[req_id] is prefill.handle and request.prefill_only
    tokens: list[int] = []
    for _ in range(50):
        for worker in (prefill, decode):
            plan = worker.core.schedule()
            if not plan_has_work(plan):
                continue
            worker.loads += plan.kv_loads
            for out in worker.core.update(worker.runner.execute(plan)):
                tokens += out.new_token_ids
            for ready in worker.core.hand_off_ready():
                placement.hand_off(worker.handle, ready)
        if len(tokens) == ANSWER_TOKENS:
            return tokens
    raise AssertionError(f"unfinished after {tokens}")


@pytest.fixture
def prefill_decode(tiny_models) -> Iterator[tuple[Worker, Worker]]:
    """A prefill and a decode worker of one pool that disaggregates PROMPT."""
    pool = WorkerPool(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=128, disaggregation_threshold=8)
    )
    prefill = Worker("prefill-0", tiny_models["llama"], pool, role=ROLE_PREFILL)
    decode = Worker("decode-0", tiny_models["llama"], pool, role=ROLE_DECODE)
    yield prefill, decode
    prefill.close()
    decode.close()


def test_a_hand_over_moves_the_prompt_kv_and_keeps_the_answer(prefill_decode):
    prefill, decode = prefill_decode
    reference = decode.answer("reference")  # colocated, then dropped from its pool
    decode.core.kv.pool.cached.clear()
    decode.loads.clear()
    assert hand_over(prefill, decode, "disaggregated") == reference
    (load,) = decode.loads
    assert (load.remote_address, load.src_tier) == (prefill.server.address, KV_DEVICE)
    assert len(load.block_ids) == (len(PROMPT) - 1) // BS
    assert all(block.ref_cnt == 0 for block in prefill.core.kv.pool.blocks)  # released


def test_a_corrupted_hand_over_is_recomputed_with_the_same_answer(tiny_models):
    pool = WorkerPool(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=128, disaggregation_threshold=8)
    )
    prefill = Worker(
        "prefill-0", tiny_models["llama"], pool, role=ROLE_PREFILL, cls=CorruptingServer
    )
    decode = Worker("decode-0", tiny_models["llama"], pool, role=ROLE_DECODE)
    try:
        reference = decode.answer("reference")
        decode.core.kv.pool.cached.clear()
        decode.loads.clear()
        assert hand_over(prefill, decode, "disaggregated") == reference
        assert len(decode.loads) == 1  # fetched once, failed its checksum, then computed
        stats = decode.runner.kv_tiers.stats
        assert stats.read(stats.load_failures) == {"checksum": 1}
    finally:
        prefill.close()
        decode.close()
