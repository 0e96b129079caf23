"""Worker metrics: KV blocks in use (shared prefix blocks once) and step phases on the CPU."""

from __future__ import annotations

import time

from services.worker.input_batch import CachedRequestState, InputBatch
from services.worker.metrics import WorkerMetrics, kv_blocks_in_use
from services.worker.step_timer import PHASES, StepTimer
from shared.wire import SamplingParams


def state(req_id: str, blocks: list[int]) -> CachedRequestState:
    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(),
        block_ids=blocks,
        num_computed_tokens=0,
    )


def test_kv_blocks_in_use_counts_shared_blocks_once():
    batch = InputBatch(max_num_reqs=4, max_model_len=64, block_size=16)
    assert kv_blocks_in_use(batch) == 0
    batch.add_request(state("a", [0, 1, 2]))
    batch.add_request(state("b", [0, 1, 7]))  # a shared two-block prefix
    assert kv_blocks_in_use(batch) == 4
    batch.remove_request("a")
    batch.condense()
    assert kv_blocks_in_use(batch) == 3


def test_cpu_phases_are_consecutive_host_intervals():
    timer = StepTimer()
    timer.begin()
    for phase in PHASES:
        time.sleep(0.002)
        timer.mark(phase)
    timer.synced()  # no-op off CUDA
    assert list(timer.seconds) == list(PHASES)
    assert all(s >= 0.002 for s in timer.seconds.values())


def test_worker_series_exist_before_the_first_step():
    metrics = WorkerMetrics("m")
    series = metrics.worker("w-0", connected=lambda: True)
    timer = StepTimer()
    timer.begin()
    timer.mark("prepare")
    timer.cuda_graph = False
    series.observe_timer(timer)
    get = metrics.registry.get_sample_value
    assert (
        get("skiff_worker_step_phase_seconds_count", {"worker_id": "w-0", "phase": "prepare"}) == 1
    )
    assert (
        get("skiff_worker_step_phase_seconds_count", {"worker_id": "w-0", "phase": "sample"}) == 0
    )
    assert get("skiff_worker_forward_steps_total", {"worker_id": "w-0", "mode": "eager"}) == 1
    assert get("skiff_worker_scheduler_epoch_changes_total", {"worker_id": "w-0"}) == 0
    assert get("skiff_nats_connected", {"worker_id": "w-0"}) == 1
