"""The decode-graph padding on the CPU: a step padded to its bucket through the static buffers
(slot -1, one-token contexts) gives the same hidden states as the unpadded eager step.
The capture itself needs CUDA and is exercised by bench/gpu.py."""

from __future__ import annotations

import torch

from services.worker.config import RunnerConfig
from services.worker.cuda_graphs import DecodeGraphs
from services.worker.model_runner import ModelRunner
from shared.sampling_params import SamplingParams
from shared.wire import BatchPlan, CachedRequestData, NewRequestData


def test_padded_static_decode_matches_eager(tiny_models):
    runner = ModelRunner(
        RunnerConfig(
            model_dir=str(tiny_models["llama"]), num_blocks=64, max_model_len=256, max_num_seqs=8
        )
    )
    params = SamplingParams(temperature=0.0)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 50)), list(range(60, 77))]
    new = [
        NewRequestData(
            req_id=f"r{i}",
            prompt_token_ids=p,
            sampling_params=params,
            block_ids=[4 * i + j for j in range(4)],
            num_computed_tokens=0,
        )
        for i, p in enumerate(prompts)
    ]
    runner.execute(
        BatchPlan(
            step_id=0,
            new_reqs=new,
            num_scheduled_tokens={f"r{i}": len(p) for i, p in enumerate(prompts)},
        )
    )
    plan = BatchPlan(
        step_id=1,
        cached_reqs=[
            CachedRequestData(req_id=f"r{i}", new_block_ids=[], num_computed_tokens=len(p))
            for i, p in enumerate(prompts)
        ],
        num_scheduled_tokens={f"r{i}": 1 for i in range(3)},
    )
    runner._update_states(plan)
    inputs = runner._prepare_inputs(plan)
    kv_before = [c.clone() for c in runner.kv_caches]
    eager = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
    kv_eager = [c.clone() for c in runner.kv_caches]
    for cache, before in zip(runner.kv_caches, kv_before, strict=True):
        cache.copy_(before)

    graphs = DecodeGraphs(
        runner.model, runner.kv_caches, 8, 16, 256, torch.device("cpu"), buckets=(1, 2, 4, 8)
    )
    bucket = graphs.bucket_for(3)
    assert bucket == 4
    graphs.load(inputs.input_ids, inputs.positions, inputs.meta, bucket)
    assert graphs.slot_mapping[3] == -1
    padded = graphs.forward_static(bucket)  # [4, hidden]
    torch.testing.assert_close(padded[:3], eager, rtol=1e-5, atol=1e-5)
    for cache, before, after in zip(runner.kv_caches, kv_before, kv_eager, strict=True):
        torch.testing.assert_close(cache, after, rtol=1e-5, atol=1e-5)
        # slot -1 would land on the very last slot had the padding row been written
        assert torch.equal(cache[:, -1, -1], before[:, -1, -1])
