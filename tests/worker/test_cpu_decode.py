"""The CPU worker's fused decode path (`skiff_cpu::decode_layers`) against the eager model: same
hidden states and the same KV-cache writes, over shuffled (non-contiguous) block tables and
mixed context lengths."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops
from kernels.lora_mapping import NO_LORA, LoRAMapping
from services.worker.attention import AttentionMetadata
from services.worker.config import RunnerConfig
from services.worker.model_runner import ModelRunner
from shared.arith import cdiv

ARCHS = ["llama", "llama3-scaled", "qwen2", "qwen3"]  # plain, tied + head_dim 32, bias, qk norm
BLOCK_SIZE = 16


def decode_meta(block_table: torch.Tensor, seq_lens: list[int]) -> AttentionMetadata:
    """One query token per request, at the last position of its context."""
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    last = lens.long() - 1
    rows = torch.arange(len(seq_lens))
    slots = block_table[rows, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE
    return AttentionMetadata(
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=lens,
        block_table=block_table,
        slot_mapping=slots,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_lens_cpu=[1] * len(seq_lens),
        seq_lens_cpu=list(seq_lens),
    )


@pytest.mark.parametrize("arch", ARCHS)
@torch.inference_mode()
def test_fused_cpu_decode_matches_eager(tiny_models, arch):
    runner = ModelRunner(
        RunnerConfig(model_dir=str(tiny_models[arch]), num_blocks=64, max_model_len=256)
    )
    assert runner.fused_cpu_decode is not None  # on by default on the CPU
    for seq_lens in ([1], [37], [100, 5, 16, 17], [1, 2], [200], [33, 33]):
        check_step(runner, seq_lens)


@pytest.mark.parametrize(
    ("arch", "cpu_weights"),
    [
        ("llama", "bf16"),
        ("qwen2", "int8"),
        ("qwen3", "bf16"),
        ("llama3-scaled", "int8"),
        ("qwen2", "q8_0"),
        ("llama3-scaled", "q8_0"),
        ("qwen2", "bf16_dot"),
        ("qwen3", "bf16_dot"),
    ],
)
@torch.inference_mode()
def test_lower_precision_weights_decode_like_the_eager_model(tiny_models, arch, cpu_weights):
    """bf16 / int8 / q8_0 / bf16_dot weights (services/worker/weight_format.py): the fused
    path computes what the eager model computes with the same stored weights (q8_0, bf16_dot:
    the same kernel on the same panels in both, so the same bits)."""
    config = RunnerConfig(
        model_dir=str(tiny_models[arch]), num_blocks=64, max_model_len=256, cpu_weights=cpu_weights
    )
    runner = ModelRunner(config)
    model = runner.model
    want = torch.bfloat16 if cpu_weights in ("bf16", "bf16_dot") else torch.int8
    head = torch.int8 if cpu_weights in ("int8", "q8_0") else torch.bfloat16
    assert model.lm_head is not None and model.lm_head.weight.dtype == head
    assert model.layers[0].mlp.down_proj.weight.dtype == want
    assert model.embed_tokens.weight.dtype == torch.float32  # lookups stay fp32
    if cpu_weights == "q8_0":  # every decoder projection in Q8_0 panels [P, in / 4, 16, 4]
        linears = [m for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
        assert all(m.weight_panels.dim() == 4 for m in linears)
        head_panels = getattr(model.lm_head, "weight_panels", None)  # fp32 x: int8's kernels
        assert head_panels is None or head_panels.dim() == 3
        assert getattr(model.lm_head, "weight_scale", None) is not None
    if cpu_weights == "bf16_dot":  # every decoder projection in pair panels [P, in / 2, 16, 2]
        linears = [m for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
        assert all(m.weight_panels.shape[2:] == (16, 2) for m in linears)
        head_panels = getattr(model.lm_head, "weight_panels", None)  # fp32 x: bf16's kernels
        assert head_panels is None or head_panels.dim() == 3
    for seq_lens in ([1], [100, 5, 16, 17]):
        check_step(runner, seq_lens, exact=cpu_weights in ("q8_0", "bf16_dot"))


@pytest.mark.parametrize(("fp32_x", "rounded_x"), [("int8", "q8_0"), ("bf16", "bf16_dot")])
@torch.inference_mode()
def test_activation_rounding_workers_stay_close_to_their_fp32_activation_peer(
    tiny_models, fp32_x, rounded_x
):
    """q8_0 runs the model with x quantized too, bf16_dot with x rounded to bf16: not the
    hidden states of the same weights with fp32 x (int8, bf16), but close to them."""
    out = {}
    for cpu_weights in (fp32_x, rounded_x):
        config = RunnerConfig(
            model_dir=str(tiny_models["qwen2"]), num_blocks=64, max_model_len=256,
            cpu_weights=cpu_weights,
        )  # fmt: skip
        runner = ModelRunner(config)
        block_table = torch.arange(8, dtype=torch.int32).view(2, 4)
        for cache in runner.kv_caches:
            cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(0)))
        meta = decode_meta(block_table, [30, 50])
        out[cpu_weights] = runner.fused_cpu_decode.forward(
            torch.tensor([5, 9]), meta.seq_lens.long() - 1, meta
        )
    assert not torch.equal(out[rounded_x], out[fp32_x])
    scale = out[fp32_x].abs().max().item()
    torch.testing.assert_close(out[rounded_x], out[fp32_x], rtol=0.05, atol=0.05 * scale)


@pytest.mark.parametrize("kernel", ["panels", "rows"])
@pytest.mark.parametrize(
    ("arch", "cpu_weights"),
    [("llama", "fp32"), ("qwen2", "fp32"), ("qwen2", "int8"), ("llama", "bf16")],
)
@torch.inference_mode()
def test_fused_decode_and_linear_op_compute_the_same_bits(
    tiny_models, arch, cpu_weights, kernel, monkeypatch
):
    """Each projection runs the same kernel on the same weights (its panels, or the row-major
    weight) in the fused decode and in the linear op, so the two paths agree bit for bit."""
    monkeypatch.setattr(cpu_ops, "linear_choice", lambda n, k, dtype: kernel)
    config = RunnerConfig(
        model_dir=str(tiny_models[arch]), num_blocks=64, max_model_len=256, cpu_weights=cpu_weights
    )
    runner = ModelRunner(config)
    linears = [m for m in runner.model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(hasattr(m, "weight_panels") == (kernel == "panels") for m in linears)
    for seq_lens in ([1], [100, 5, 16, 17]):
        check_step(runner, seq_lens, exact=True)


@torch.inference_mode()
def test_fused_cpu_decode_adds_lora_like_the_eager_model(tiny_models):
    """Decode steps with LoRA adapters stay on the fused path: each projection adds its tokens'
    adapter updates (two adapters and base tokens in one step) as the eager model does."""
    config = RunnerConfig(
        model_dir=str(tiny_models["qwen2"]), num_blocks=64, max_model_len=256,
        enable_lora=True, max_loras=2, max_lora_rank=16,
    )  # fmt: skip
    runner = ModelRunner(config)
    assert runner.fused_cpu_decode is not None and runner.fused_cpu_decode.runs_lora
    assert runner.lora is not None
    gen = torch.Generator().manual_seed(3)
    for module in runner.lora.weights.modules.values():
        module.lora_a.copy_(torch.randn(module.lora_a.shape, generator=gen) * 0.1)
        module.lora_b.copy_(torch.randn(module.lora_b.shape, generator=gen) * 0.1)
    lora = LoRAMapping.build(torch.tensor([0, NO_LORA, 1, 0]))
    with_lora = check_step(runner, [100, 5, 16, 17], lora=lora)
    base = check_step(runner, [100, 5, 16, 17])  # the same inputs, no adapter
    assert torch.equal(with_lora[1], base[1])  # the base token's bits
    assert all(not torch.equal(with_lora[i], base[i]) for i in (0, 2, 3))


def check_step(
    runner: ModelRunner, seq_lens: list[int], exact: bool = False, lora: LoRAMapping | None = None
) -> torch.Tensor:
    """The fused path's hidden states of a decode step, checked against the eager model's."""
    gen = torch.Generator().manual_seed(len(seq_lens) * 1000 + sum(seq_lens))
    for cache in runner.kv_caches:  # earlier context: random keys and values
        cache.copy_(torch.randn(cache.shape, generator=gen))
    width = max(cdiv(n, BLOCK_SIZE) for n in seq_lens)
    blocks = torch.randperm(64, generator=gen)[: width * len(seq_lens)]
    block_table = blocks.view(len(seq_lens), width).to(torch.int32)
    meta = decode_meta(block_table, seq_lens)
    input_ids = torch.randint(2, 200, (len(seq_lens),), generator=gen)
    positions = meta.seq_lens.long() - 1
    before = [c.clone() for c in runner.kv_caches]

    if lora is None:
        eager = runner.model(input_ids, positions, runner.kv_caches, meta)
    else:
        with runner.lora.step.use(lora):
            eager = runner.model(input_ids, positions, runner.kv_caches, meta)
    eager_caches = [c.clone() for c in runner.kv_caches]
    for cache, saved in zip(runner.kv_caches, before, strict=True):
        cache.copy_(saved)
    meta = decode_meta(block_table, seq_lens)
    fused = runner.fused_cpu_decode.forward(input_ids, positions, meta, lora)

    tolerance = 0.0 if exact else 1e-5
    torch.testing.assert_close(fused, eager, rtol=tolerance, atol=tolerance)
    for got, want in zip(runner.kv_caches, eager_caches, strict=True):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    return fused


def test_fused_cpu_decode_off_runs_eager(tiny_models):
    config = RunnerConfig(model_dir=str(tiny_models["llama"]), num_blocks=8, fused_cpu_decode=False)
    assert ModelRunner(config).fused_cpu_decode is None


def test_weights_stay_row_major_for_the_cpu_ops_kernel(tiny_models):
    """The C++ kernel builds on the CPU worker and streams contiguous [out, in] weights; a
    packed projection holds its panels instead (its weight is a meta placeholder)."""
    runner = ModelRunner(
        RunnerConfig(model_dir=str(tiny_models["qwen2"]), num_blocks=8, fused_cpu_decode=False)
    )
    assert cpu_ops.active()
    linears = [m for m in runner.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears
    for module in linears:
        panels = getattr(module, "weight_panels", None)
        if panels is None:
            assert not module.weight.is_meta and module.weight.is_contiguous()
        else:
            assert module.weight.is_meta and panels.is_contiguous()


@torch.inference_mode()
def test_decode_layers_refuses_a_layer_without_its_weights(tiny_models):
    """`decode_layers` takes 13 weights per layer, the norms and projections required: a list
    that lacks one is a clear error, not a read of whatever memory follows."""
    runner = ModelRunner(RunnerConfig(model_dir=str(tiny_models["llama"]), num_blocks=64))
    fused = runner.fused_cpu_decode
    assert fused is not None
    meta = decode_meta(torch.arange(2, dtype=torch.int32).view(1, 2), [20])
    input_ids, positions = torch.tensor([5]), torch.tensor([19])
    weights = fused.weights
    try:
        fused.weights = weights[:-1]  # one entry short
        with pytest.raises(RuntimeError, match="13 weights per layer"):
            fused.forward(input_ids, positions, meta)
        fused.weights = [None if i == 7 else w for i, w in enumerate(weights)]  # no gate_up
        with pytest.raises(RuntimeError, match="lacks a norm or weight"):
            fused.forward(input_ids, positions, meta)
    finally:
        fused.weights = weights
    fused.forward(input_ids, positions, meta)  # the whole list runs
