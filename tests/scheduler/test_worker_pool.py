"""Per-worker cores from hellos, and the choice of a worker for a new request."""

from __future__ import annotations

from services.scheduler.request import Request
from services.scheduler.worker_pool import WorkerPool
from shared.config import SchedulerConfig
from shared.sampling_params import SamplingParams
from shared.wire import ModelRunnerOutput
from tests.scheduler.fakes import make_hello, unpaced_config


def request(req_id: str, token_ids: list[int], max_tokens: int = 8) -> Request:
    return Request(req_id, token_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))


def test_core_takes_the_smaller_max_num_seqs():
    pool = WorkerPool(SchedulerConfig(max_num_seqs=8))
    small, _ = pool.register(make_hello("small", max_num_seqs=3))
    large, _ = pool.register(make_hello("large", max_num_seqs=64))
    assert small.core.config.max_num_seqs == 3
    assert large.core.config.max_num_seqs == 8
    for i in range(5):
        small.core.add_request(request(f"r{i}", [10 + i] * 5))
    plan = small.core.schedule()  # never more rows than the worker's persistent batch has
    assert len(plan.num_scheduled_tokens) == 3


def test_core_takes_the_worker_block_size_and_smaller_max_model_len():
    pool = WorkerPool(SchedulerConfig(max_model_len=4096, block_size=16))
    worker, replaced = pool.register(make_hello(block_size=32, max_model_len=2048))
    assert replaced is None
    assert worker.core.config.block_size == 32 and worker.core.max_model_len == 2048
    assert pool.max_model_len == 2048


def test_placement_counts_each_worker_in_its_own_blocks():
    pool = WorkerPool(unpaced_config())
    pool.register(make_hello("w16", block_size=16))
    w32, _ = pool.register(make_hello("w32", block_size=32))
    prefix = list(range(100, 165))  # 65 tokens: two full blocks of 32, four of 16
    # run a request through w32 so that its two blocks of 32 stay cached, then free
    w32.core.add_request(request("warm", prefix, max_tokens=1))
    plan = w32.core.schedule()
    w32.core.update(
        ModelRunnerOutput(step_id=plan.step_id, req_ids=["warm"], sampled_token_ids=[[7]])
    )
    assert not w32.core.has_unfinished() and w32.core.num_used_blocks == 0
    new = request("new", [*prefix[:64], 1, 2, 3])
    assert w32.core.num_uncached_blocks(new.all_token_ids) == 0
    assert pool.workers["w16"].core.num_uncached_blocks(new.all_token_ids) == 4
    assert pool.select(new) is w32


def test_placement_prefers_the_less_loaded_worker():
    pool = WorkerPool(SchedulerConfig())
    busy, _ = pool.register(make_hello("busy"))
    idle, _ = pool.register(make_hello("idle"))
    busy.core.add_request(request("a", list(range(40))))
    busy.core.schedule()
    assert busy.core.num_used_blocks == 3
    assert pool.select(request("b", list(range(500, 510)))) is idle


def test_load_of_workers_with_different_block_sizes_compares_in_tokens():
    pool = WorkerPool(unpaced_config())
    w16, _ = pool.register(make_hello("w16", block_size=16))
    w32, _ = pool.register(make_hello("w32", block_size=32))
    w16.core.add_request(request("a", list(range(60))))  # 4 blocks of 16: 64 tokens
    w32.core.add_request(request("b", list(range(70))))  # 3 blocks of 32: 96 tokens
    w16.core.schedule()
    w32.core.schedule()
    assert (w16.core.num_used_blocks, w32.core.num_used_blocks) == (4, 3)
    # fewer blocks in use on w32, but more tokens: a cold request belongs on w16
    assert pool.select(request("c", list(range(500, 510)))) is w16


def test_a_burst_spreads_before_any_of_it_holds_blocks():
    pool = WorkerPool(SchedulerConfig())
    for wid in ("a", "b", "c", "d"):
        pool.register(make_hello(wid))
    for i in range(16):  # all placed before any worker schedules (no block is in use yet)
        r = request(f"r{i}", [100 + i] * 40)
        pool.select(r).core.add_request(r)
    assert sorted(len(w.core.waiting) for w in pool.workers.values()) == [4, 4, 4, 4]
