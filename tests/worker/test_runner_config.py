"""RunnerConfig is validated at construction; build_runner sizes the KV cache from
kv_cache_gib unless num_blocks is given."""

from __future__ import annotations

import pytest

from services.worker.config import RunnerConfig
from services.worker.model_config import ModelConfig
from services.worker.model_runner import ModelRunner, build_runner, num_kv_blocks


@pytest.mark.parametrize(
    "bad",
    [
        dict(block_size=0),
        dict(max_num_seqs=0),
        dict(max_model_len=0),
        dict(num_blocks=0),
        dict(kv_cache_gib=0.0),
        dict(dtype="float33"),
        dict(dtype="int64"),
        dict(cpu_weights="fp16"),
        dict(cpu_weights="int8", device="cuda"),
        dict(cpu_weights="bf16", dtype="bfloat16"),
    ],
)
def test_invalid_config_is_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        RunnerConfig(model_dir="unused", **bad)


def test_build_runner_sizes_the_kv_cache(tiny_models):
    model_dir = str(tiny_models["llama"])
    runner = build_runner(RunnerConfig(model_dir, kv_cache_gib=0.001, max_model_len=256))
    want = num_kv_blocks(
        ModelConfig.from_dir(model_dir), runner.config.block_size, 0.001, "float32"
    )
    assert runner.num_blocks == runner.config.num_blocks == want
    assert runner.kv_caches[0].shape[1] == want
    assert build_runner(RunnerConfig(model_dir, num_blocks=7)).num_blocks == 7
    with pytest.raises(ValueError, match="build_runner"):
        ModelRunner(RunnerConfig(model_dir))
