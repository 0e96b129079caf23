"""Packed projections (services/worker/weight_format.py pack_panels) keep their weights once:
the row-major copy becomes a meta placeholder, which no path reads: the logits are the bits of
a model that keeps both copies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels import cpu_ops
from services.worker.config import RunnerConfig
from services.worker.model_runner import ModelRunner
from services.worker.weight_format import unpack_weights
from tests.worker.test_cpu_decode import BLOCK_SIZE, decode_meta


def runner(tiny_models, arch: str, cpu_weights: str = "fp32") -> ModelRunner:
    config = RunnerConfig(
        model_dir=str(tiny_models[arch]), num_blocks=64, max_model_len=256, cpu_weights=cpu_weights
    )
    return ModelRunner(config)


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@pytest.mark.parametrize("cpu_weights", ["fp32", "int8", "q8_0", "bf16_dot"])
def test_packed_projections_take_their_bytes_once(tiny_models, cpu_weights, monkeypatch):
    monkeypatch.setattr(cpu_ops, "linear_choice", lambda n, k, dtype: "panels")
    model = runner(tiny_models, "qwen2", cpu_weights).model  # qwen2: biases too
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(m.weight.is_meta and hasattr(m, "weight_panels") for m in linears)
    # One copy: what the row-major weight, its scales and bias took (shape and dtype kept) ...
    row_major = sum(
        nbytes(m.weight) + nbytes(getattr(m, "weight_scale", None)) + nbytes(m.bias)
        for m in linears
    )
    # ... against what stays in memory: the panels (out padded to 16), their scales, the bias.
    resident = sum(
        nbytes(t) for m in linears for t in [*m.parameters(), *m.buffers()] if not t.is_meta
    )
    assert row_major < resident < 1.1 * row_major, (resident, row_major)


@pytest.mark.parametrize(("arch", "cpu_weights"), [("llama", "fp32"), ("qwen2", "int8")])
@torch.inference_mode()
def test_meta_weights_compute_the_bits_of_both_copies(tiny_models, arch, cpu_weights):
    """The eager and the fused decode logits of the packed model equal those of the same model
    given its row-major weights back beside the panels (what pack_panels kept before)."""
    packed = runner(tiny_models, arch, cpu_weights)
    both = runner(tiny_models, arch, cpu_weights)
    restored = 0
    for module in both.model.modules():
        panels = getattr(module, "weight_panels", None)
        if isinstance(module, nn.Linear) and panels is not None:
            n = module.weight.shape[0]
            weight = cpu_ops.unpack_panels(panels, n).contiguous()
            module.weight = nn.Parameter(weight, requires_grad=False)
            scale = getattr(module, "weight_panel_scale", None)
            if scale is not None:
                module.weight_scale = cpu_ops.unpack_panels(scale, n).contiguous()
            restored += 1
    assert restored  # some projections run the panel kernel here

    gen = torch.Generator().manual_seed(7)
    seq_lens = [100, 5, 16, 17]
    caches = [torch.randn(c.shape, generator=gen) for c in packed.kv_caches]
    block_table = torch.randperm(64, generator=gen)[:28].view(4, 7).to(torch.int32)
    input_ids = torch.randint(2, 200, (len(seq_lens),), generator=gen)
    positions = torch.tensor(seq_lens) - 1
    assert max(seq_lens) <= 7 * BLOCK_SIZE
    logits = []
    for r in (packed, both):
        for cache, saved in zip(r.kv_caches, caches, strict=True):
            cache.copy_(saved)
        eager = r.model(input_ids, positions, r.kv_caches, decode_meta(block_table, seq_lens))
        assert r.fused_cpu_decode is not None
        for cache, saved in zip(r.kv_caches, caches, strict=True):
            cache.copy_(saved)
        fused = r.fused_cpu_decode.forward(input_ids, positions, decode_meta(block_table, seq_lens))
        logits.append((r.model.compute_logits(eager), r.model.compute_logits(fused)))
    assert torch.equal(logits[0][0], logits[1][0])
    assert torch.equal(logits[0][1], logits[1][1])


def test_unpack_weights_gives_back_the_row_major_weights(tiny_models, monkeypatch):
    """bench/cpu_step.py's torch engine: the packed model's weights, unpacked, equal the
    weights of the model loaded without panels."""
    monkeypatch.setattr(cpu_ops, "linear_choice", lambda n, k, dtype: "rows")
    rows = runner(tiny_models, "qwen2").model
    monkeypatch.setattr(cpu_ops, "linear_choice", lambda n, k, dtype: "panels")
    packed = runner(tiny_models, "qwen2").model
    unpack_weights(packed)
    pairs = list(zip(rows.modules(), packed.modules(), strict=True))
    linears = [(a, b) for a, b in pairs if isinstance(a, nn.Linear)]
    assert linears
    for want, got in linears:
        assert not hasattr(got, "weight_panels")
        assert got.weight.is_contiguous() and torch.equal(got.weight, want.weight)
    with pytest.raises(ValueError, match="only fp32 / bf16 panels"):
        unpack_weights(runner(tiny_models, "qwen2", "q8_0").model)
