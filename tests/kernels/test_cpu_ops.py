"""The C++ CPU ops (kernels/csrc/cpu_ops.cpp) against their references: `linear` against
float64 (every tile remainder, chunk boundary and weight-row tail, bias, non-contiguous inputs,
lower-precision weights, the shapes it hands back to torch) and the elementwise ops against
kernels/reference.py; prefill attention (tiles of query rows against tiles of keys) against
the reference at 1 to 8k tokens with grouped-query heads. The attention backend:
tests/worker/test_cpu_backend.py; the fused decode layer: tests/worker/test_cpu_decode.py."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn import functional as F

from kernels import cpu_ops, ops
from kernels import reference as torch_reference
from services.worker.weight_format import INT8_GROUP, quantize_int8
from tests.cpu_isa import running_isa

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True, params=cpu_ops.ISAS)
def kernel(request):
    """Every test runs with each instruction set's kernels that this CPU can run."""
    with running_isa(request.param) as isa:
        yield isa


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return out.float()


# N: multiples of the 4-row block, and tails of 1-3 rows; K: multiples of 16.
SHAPES = [(8, 16), (13, 48), (130, 64), (962, 576)]  # (out_features, in_features)


def stored_as(
    weight_format: str, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """fp32 [N, K] -> (the weight stored as bf16 or group-scaled int8, int8's scales
    [N, K / 32] or None, the fp32 weight the stored one stands for)."""
    if weight_format == "bf16":
        stored = weight.to(torch.bfloat16)
        return stored, None, stored.float()
    stored, scale = quantize_int8(weight)
    groups = stored.float().view(weight.shape[0], -1, INT8_GROUP) * scale.unsqueeze(2)
    return stored, scale, groups.view_as(weight)


# M: 1 (no prefetch), 2-7 (tile remainders), 63/64/65/130 (64-row chunks).
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 7, 63, 64, 65, 130])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_reference(num_tokens, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(num_tokens * 7919 + out_features)
    x = torch.randn(num_tokens, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    got = torch.ops.skiff_cpu.linear(x, weight, bias)
    assert got.shape == (num_tokens, out_features)
    torch.testing.assert_close(got, reference(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("weight_format", ["bf16", "int8"])
@pytest.mark.parametrize("num_tokens", [1, 2, 5, 65])
@pytest.mark.parametrize(("out_features", "in_features"), [(13, 64), (962, 576)])
def test_lower_precision_weights_match_their_dequantized_reference(
    weight_format, num_tokens, out_features, in_features
):
    """bf16 and group-scaled int8 weights: the products and sums are fp32, so the result is
    that of the fp32 weights they stand for."""
    gen = torch.Generator().manual_seed(num_tokens + out_features)
    x = torch.randn(num_tokens, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    stored, scale, dequantized = stored_as(weight_format, weight)
    got = torch.ops.skiff_cpu.linear(x, stored, None, scale)
    torch.testing.assert_close(got, reference(x, dequantized, None), rtol=1e-5, atol=1e-4)
    # and where the kernel does not apply (a transposed input dim), torch gets the same weight
    fallback = torch.ops.skiff_cpu.linear(x.double(), stored, None, scale)
    torch.testing.assert_close(fallback, reference(x, dequantized, None).double())


def test_int8_quantization_error_is_half_a_step():
    weight = torch.randn(64, 128) * torch.logspace(-3, 1, 128)  # groups of very different scale
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and scale.shape == (64, 128 // INT8_GROUP)
    step = scale.repeat_interleave(INT8_GROUP, dim=1)
    assert ((q.float() * step - weight).abs() <= step / 2 + 1e-7).all()


def test_leading_dims_and_non_contiguous_input():
    x = torch.randn(64, 3, 5).transpose(0, 2)  # [5, 3, 64], not contiguous
    weight = torch.randn(20, 64)
    got = torch.ops.skiff_cpu.linear(x, weight)
    assert got.shape == (5, 3, 20)
    torch.testing.assert_close(got, reference(x, weight, None), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("x", "weight"),
    [
        (torch.randn(3, 40), torch.randn(8, 40)),  # K not a multiple of 16
        (torch.randn(3, 32, dtype=torch.float64), torch.randn(8, 32, dtype=torch.float64)),
        (torch.randn(3, 32), torch.randn(32, 8).t()),  # a transposed (non-contiguous) weight
        (torch.randn(0, 32), torch.randn(8, 32)),  # no tokens
    ],
)
def test_shapes_it_does_not_cover_fall_back_to_torch(x, weight):
    got = torch.ops.skiff_cpu.linear(x, weight)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_ops_linear_routes_cpu_tensors_to_the_kernel():
    x, weight = torch.randn(2, 32), torch.randn(8, 32)
    with torch.profiler.profile() as prof:
        ops.linear(x, weight)
    assert "skiff_cpu::linear" in {event.name for event in prof.events()}


# Panels: N a multiple of the 16-wide panel or not; K below, at and past the 256-deep k-block,
# and not a multiple of 16. M: every register-tile height (6 rows in AVX2, 8 in AVX-512) and
# its remainders, and 300 rows.
PANEL_SHAPES = [(16, 16), (13, 48), (130, 64), (50, 600), (962, 576), (40, 37)]
PANEL_ROWS = [*range(1, 12), 300]


@pytest.mark.parametrize(("out_features", "in_features"), PANEL_SHAPES)
def test_panels_pack_and_unpack(out_features, in_features):
    weight = torch.randn(out_features, in_features)
    packed = cpu_ops.pack_panels(weight)
    assert packed.shape == (-(-out_features // cpu_ops.PANEL), in_features, cpu_ops.PANEL)
    assert packed[0, 1, 2] == weight[2, 1]
    assert torch.equal(cpu_ops.unpack_panels(packed, out_features), weight)
    if out_features % cpu_ops.PANEL:
        assert not packed[-1, :, out_features % cpu_ops.PANEL :].any()  # zero past N


@pytest.mark.parametrize("num_tokens", PANEL_ROWS)
@pytest.mark.parametrize(("out_features", "in_features"), PANEL_SHAPES)
def test_panel_kernel_matches_reference(num_tokens, out_features, in_features):
    gen = torch.Generator().manual_seed(num_tokens * 31 + out_features)
    x = torch.randn(num_tokens, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    packed = cpu_ops.pack_panels(weight)
    got = torch.ops.skiff_cpu.linear_packed(x, packed, out_features, bias)
    assert got.shape == (num_tokens, out_features)
    torch.testing.assert_close(got, reference(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("weight_format", ["bf16", "int8"])
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 6, 7, 9, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(13, 64), (130, 64), (50, 608)])
def test_lower_precision_panels_match_their_dequantized_reference(
    weight_format, num_tokens, out_features, in_features
):
    """bf16 and int8 panels (int8 scales packed alike): fp32 products and sums of the fp32
    weights they stand for, and the row kernel's result to fp32 rounding. One or two rows
    dequantize in the register tile, more rows once per k-block: the same bits."""
    gen = torch.Generator().manual_seed(num_tokens + 3 * out_features)
    x = torch.randn(num_tokens, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    stored, scale, dequantized = stored_as(weight_format, weight)
    packed = cpu_ops.pack_panels(stored)
    packed_scale = None if scale is None else cpu_ops.pack_panels(scale)
    assert packed.dtype == stored.dtype
    got = torch.ops.skiff_cpu.linear_packed(x, packed, out_features, None, packed_scale)
    torch.testing.assert_close(got, reference(x, dequantized, None), rtol=1e-5, atol=1e-4)
    rows = torch.ops.skiff_cpu.linear(x, stored, None, scale)
    torch.testing.assert_close(got, rows, rtol=1e-5, atol=1e-4)
    alone = torch.cat(
        [torch.ops.skiff_cpu.linear_packed(r, packed, out_features, None, packed_scale) for r in x]
    )
    assert torch.equal(alone.view_as(got), got)  # bit-identical one row at a time


def test_panels_with_mismatched_scales_are_refused():
    stored, scale = quantize_int8(torch.randn(20, 64))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="linear_packed"):
        torch.ops.skiff_cpu.linear_packed(x, cpu_ops.pack_panels(stored), 20)  # no scales
    with pytest.raises(RuntimeError, match="linear_packed"):  # row-major scales
        torch.ops.skiff_cpu.linear_packed(x, cpu_ops.pack_panels(stored), 20, None, scale)
    with pytest.raises(RuntimeError, match="linear_packed"):  # panels for another N
        torch.ops.skiff_cpu.linear_packed(x, cpu_ops.pack_panels(torch.randn(20, 64)), 40)


@pytest.mark.parametrize(("out_features", "in_features"), [(130, 64), (962, 576), (50, 600)])
def test_panel_rows_are_bit_identical_in_any_batch(out_features, in_features):
    """A row's outputs do not depend on M, its place in the batch or the tile that ran it:
    each output is one fma chain over k in order."""
    gen = torch.Generator().manual_seed(out_features)
    x = torch.randn(300, in_features, generator=gen)
    packed = cpu_ops.pack_panels(torch.randn(out_features, in_features, generator=gen))
    alone = torch.stack([torch.ops.skiff_cpu.linear_packed(row, packed, out_features) for row in x])
    assert torch.equal(alone, torch.ops.skiff_cpu.linear_packed(x, packed, out_features))
    for start, rows in [(0, 2), (3, 5), (7, 6), (11, 8), (1, 9), (2, 13), (5, 64), (40, 199)]:
        got = torch.ops.skiff_cpu.linear_packed(x[start : start + rows], packed, out_features)
        assert torch.equal(got, alone[start : start + rows]), (start, rows)


def test_panel_kernel_bits_match_across_instruction_sets():
    """The fma chains run in the same order in every instruction set's tiles."""
    x, weight = torch.randn(23, 576), torch.randn(100, 576)
    packed = cpu_ops.pack_panels(weight)
    here = torch.ops.skiff_cpu.linear_packed(x, packed, 100)
    widest = cpu_ops.isa()
    for name in cpu_ops.ISAS:
        if cpu_ops.use_isa(name):
            assert torch.equal(torch.ops.skiff_cpu.linear_packed(x, packed, 100), here), name
    cpu_ops.use_isa(widest)


def test_ops_linear_routes_packed_weights_to_the_panel_kernel():
    x, weight, bias = torch.randn(5, 32), torch.randn(24, 32), torch.randn(24)
    packed = cpu_ops.pack_panels(weight)
    with torch.profiler.profile() as prof:
        got = ops.linear(x, weight, bias, None, packed)
    assert "skiff_cpu::linear_packed" in {event.name for event in prof.events()}
    assert torch.equal(got, torch.ops.skiff_cpu.linear_packed(x, packed, 24, bias))
    cpu_ops.use(False)  # torch's ops: the row-major weight, or the panels unpacked for a meta one
    try:
        torch.testing.assert_close(
            ops.linear(x, weight, bias, None, packed), F.linear(x, weight, bias)
        )
        placeholder = weight.to("meta")  # services/worker/weight_format.py pack_panels
        assert torch.equal(
            ops.linear(x, placeholder, bias, None, packed), F.linear(x, weight, bias)
        )
        with pytest.raises(ValueError, match="meta weight"):
            ops.linear(x, placeholder, bias)
    finally:
        cpu_ops.use(True)


def test_linear_choice_is_timed_once_and_cached_on_disk(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cpu_ops, "_choice_file", lambda: tmp_path / "choice.json")
    monkeypatch.setattr(cpu_ops, "_choices", None)
    timings = {"rows": 10.0, "panels": 5.0}
    calls = []

    def fake_timing(n: int, k: int, rows: int, weight: object) -> dict[str, float]:
        calls.append((n, k, rows))
        return timings

    monkeypatch.setattr(cpu_ops, "time_kernels", fake_timing)
    with caplog.at_level("INFO", logger="skiff.kernels.cpu_ops"):
        assert cpu_ops.linear_choice(96, 64) == "panels"
    assert calls == [(96, 64, 1), (96, 64, 64)]
    assert "float32 96x64: panels" in caplog.text
    timings = {"rows": 5.0, "panels": 10.0}
    assert cpu_ops.linear_choice(96, 64) == "panels"  # cached in memory
    monkeypatch.setattr(cpu_ops, "_choices", None)
    assert cpu_ops.linear_choice(96, 64) == "panels"  # cached on disk
    assert len(calls) == 2
    assert cpu_ops.linear_choice(96, 32) == "rows"  # another shape: timed
    assert len(calls) == 4
    assert cpu_ops.linear_choice(96, 32, torch.int8) == "rows"  # another format: timed
    assert len(calls) == 6
    assert cpu_ops.linear_choice(96, 40) == "panels"  # only panels take K % 16 != 0
    key = f"{cpu_ops.cpu_model()} | {cpu_ops.isa()} | float32 96x64"
    assert key in (tmp_path / "choice.json").read_text()


def test_linear_choice_takes_another_process_s_choice(tmp_path, monkeypatch):
    """A choice another process timed and wrote after this one read the file wins over timing
    it again, so every process on the machine runs the same kernel for a shape."""
    path = tmp_path / "choice.json"
    monkeypatch.setattr(cpu_ops, "_choice_file", lambda: path)
    monkeypatch.setattr(cpu_ops, "_choices", {})  # read before the other process wrote
    key = f"{cpu_ops.cpu_model()} | {cpu_ops.isa()} | float32 96x64"
    path.write_text(json.dumps({key: "rows"}))

    def no_timing(*args: object, **kwargs: object) -> dict[str, float]:
        raise AssertionError("timed a shape another process had chosen")

    monkeypatch.setattr(cpu_ops, "time_kernels", no_timing)
    assert cpu_ops.linear_choice(96, 64) == "rows"


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("hidden", [16, 40, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(num_tokens, hidden, with_residual):
    gen = torch.Generator().manual_seed(num_tokens * hidden)
    x = torch.randn(num_tokens, hidden, generator=gen) * 3
    weight = torch.randn(hidden, generator=gen)
    residual = torch.randn(num_tokens, hidden, generator=gen) if with_residual else None
    got = torch.ops.skiff_cpu.rms_norm(x, weight, 1e-6, residual)
    want = torch_reference.rms_norm(x, weight, 1e-6, residual)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("head_dim", "rot_dim"), [(64, 64), (32, 16), (80, 80)])
def test_rotary_embedding_matches_reference(head_dim, rot_dim):
    gen = torch.Generator().manual_seed(head_dim + rot_dim)
    angles = torch.rand(300, rot_dim // 2, generator=gen) * 50
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, 300, (11,), generator=gen)
    qkv = torch.randn(11, 6 * head_dim, generator=gen)
    query = qkv[:, : 4 * head_dim].view(11, 4, head_dim)  # views of a fused row, as the model
    key = qkv[:, 4 * head_dim :].view(11, 2, head_dim)
    got = torch.ops.skiff_cpu.rotary_embedding(positions, query, key, cache)
    want = torch_reference.rotary_embedding(positions, query, key, cache)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("intermediate", [8, 40, 1536])
def test_silu_and_mul_matches_reference(intermediate):
    gen = torch.Generator().manual_seed(intermediate)
    x = torch.randn(9, 2 * intermediate, generator=gen) * 6  # exp of large and small gates
    x[0, :4] = torch.tensor([-100.0, 100.0, -90.0, 0.0])
    got = torch.ops.skiff_cpu.silu_and_mul(x)
    torch.testing.assert_close(got, torch_reference.silu_and_mul(x), rtol=1e-5, atol=1e-6)


def prefill_case(q_len, context, heads, kv_heads, head_dim, block_size=16, seed=0):
    """One request: q_len new tokens after `context` cached ones, in scattered cache blocks.
    Returns (query, kv_cache, query_start_loc, seq_lens, block_table)."""
    gen = torch.Generator().manual_seed(seed)
    seq_len = context + q_len
    num_blocks = -(-seq_len // block_size) + 2
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32)[None]  # [1, num_blocks]
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    query = torch.randn(q_len, heads, head_dim, generator=gen) * 3  # peaked softmax rows
    qsl = torch.tensor([0, q_len], dtype=torch.int32)
    return query, kv_cache, qsl, torch.tensor([seq_len], dtype=torch.int32), table


def chunked_reference(query, kv_cache, qsl, seq_lens, table, scale, rows=1024):
    """reference.paged_attention of a prefill_case over slices of its query: row i sees
    positions up to seq_len - q_len + i either way, and [heads, q_len, seq_len] is never whole."""
    q_len, seq_len, parts = query.shape[0], int(seq_lens[0]), []
    for lo in range(0, q_len, rows):
        hi = min(q_len, lo + rows)
        part_qsl = torch.tensor([0, hi - lo], dtype=torch.int32)
        lens = torch.tensor([seq_len - q_len + hi], dtype=torch.int32)
        part = torch_reference.paged_attention(query[lo:hi], kv_cache, part_qsl, lens, table, scale)
        parts.append(part)
    return torch.cat(parts)  # [q_len, heads, head_dim]


def paged_attention(query, kv_cache, qsl, seq_lens, table, scale):
    slots = kv_cache.flatten(1, 2)  # [2, num_slots, kv_heads, head_dim]
    block_size = kv_cache.shape[2]
    return torch.ops.skiff_cpu.paged_attention(
        query, slots[0], slots[1], qsl, seq_lens, table, scale, block_size
    )


# 1 token (the decode path), 63/64/65 (the 64-key tile and the 21-token query tile of GQA 3
# around them), 2k and 8k (many key tiles: the online softmax's rescaling).
@pytest.mark.parametrize("q_len", [1, 63, 64, 65, 2048, 8192])
def test_prefill_attention_matches_reference(q_len):
    heads, kv_heads, head_dim = (9, 3, 64) if q_len < 8192 else (4, 2, 64)
    case = prefill_case(q_len, 0, heads, kv_heads, head_dim)
    got = paged_attention(*case, head_dim**-0.5)
    want = chunked_reference(*case, head_dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# Chunks after cached context (from mid-block, and one that is a single key tile's worth of
# context), every tile size of query rows (group 1, 3, 4, 6 -> 64, 21, 16, 10 tokens), head
# dims other than 64, a tile of fewer than 16 rows (2 tokens x 6 heads).
@pytest.mark.parametrize(
    ("q_len", "context", "heads", "kv_heads", "head_dim"),
    [(100, 37, 4, 4, 80), (130, 64, 8, 2, 64), (50, 3, 6, 1, 128), (2, 200, 6, 1, 64),
     (300, 1800, 9, 3, 64), (17, 0, 12, 3, 32)],
)  # fmt: skip
def test_prefill_chunk_after_context_matches_reference(q_len, context, heads, kv_heads, head_dim):
    case = prefill_case(q_len, context, heads, kv_heads, head_dim, seed=q_len)
    got = paged_attention(*case, head_dim**-0.5)
    want = chunked_reference(*case, head_dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_len", [22, 43, 64])
def test_prefill_rows_do_not_depend_on_the_chunk(q_len):
    """A prefill token's attention has the same bits whatever chunk of 2 or more tokens it is
    in and wherever in it, its chunk's last alone in a query tile included (9 heads over 3 KV
    heads: tiles of 21 tokens), so its logits and the KV of later layers match however a
    prompt was chunked. (A one-token step is a decode step: its kernel matches to rounding.)"""
    query, kv_cache, qsl, seq_lens, table = prefill_case(q_len, 30, 9, 3, 64, seed=q_len)
    whole = paged_attention(query, kv_cache, qsl, seq_lens, table, 0.125)
    for tail in (2, 5, 21):  # the chunk's last `tail` tokens after the rest was computed
        part = paged_attention(
            query[-tail:], kv_cache, torch.tensor([0, tail], dtype=torch.int32), seq_lens,
            table, 0.125,
        )  # fmt: skip
        assert torch.equal(part, whole[-tail:]), tail


def test_prefill_tiles_equal_one_request_per_token():
    """A chunk's tokens as separate one-token requests (the decode path, the context read
    once per token) give what the tiled chunk gives, in one step with other requests."""
    case = prefill_case(70, 30, 9, 3, 64, seed=5)
    query, kv_cache, _, _, table = case
    tiled = paged_attention(*case, 0.125)
    per_token = paged_attention(
        query, kv_cache, torch.arange(71, dtype=torch.int32),
        torch.arange(31, 101, dtype=torch.int32), table.expand(70, -1).contiguous(), 0.125,
    )  # fmt: skip
    torch.testing.assert_close(tiled, per_token, rtol=1e-5, atol=1e-5)


# Q8_0 x Q8_0 (W8A8): int8 weights in Q8_0 panels, x quantized per row and group of 32.
Q8_SHAPES = [(16, 32), (13, 64), (130, 64), (50, 608), (962, 576)]


def q8_reference(x: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Q8_0 x Q8_0 in plain torch: x [M, K] quantized per group of 32 (scale max |x| / 127,
    round half to even), exact integer dot products per group, times both fp32 scales (their
    fp32 product), summed in float64."""
    groups = x.view(x.shape[0], -1, INT8_GROUP)  # [M, G, 32]
    x_scale = groups.abs().amax(dim=2, keepdim=True) / 127  # [M, G, 1]
    xq = torch.where(x_scale > 0, torch.round(groups / x_scale), 0.0).clamp(-127, 127)
    wq = stored.view(stored.shape[0], -1, INT8_GROUP)  # [N, G, 32]
    dots = torch.einsum("mgk,ngk->mng", xq.long(), wq.long())  # [M, N, G], exact
    both = scale.unsqueeze(0) * x_scale.squeeze(2).unsqueeze(1)  # [M, N, G] fp32 products
    return (dots.double() * both.double()).sum(dim=2)


def q8_weight(
    out_features: int, in_features: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 weight, its scales, their Q8_0 panels, the scales' panels)."""
    stored, scale = quantize_int8(torch.randn(out_features, in_features, generator=gen))
    return stored, scale, cpu_ops.pack_q8_panels(stored), cpu_ops.pack_panels(scale)


def test_q8_panels_pack_quads_of_k_side_by_side():
    stored, _ = quantize_int8(torch.randn(20, 64))
    packed = cpu_ops.pack_q8_panels(stored)
    assert packed.shape == (2, 16, cpu_ops.PANEL, 4) and packed.dtype == torch.int8
    assert torch.equal(packed[1, 3, 2], stored[18, 12:16])  # panel 1, quad 3, lane 2
    assert not packed[1, :, 4:].any()  # zero past N
    with pytest.raises(ValueError, match="K % 32"):
        cpu_ops.pack_q8_panels(torch.zeros(16, 48, dtype=torch.int8))
    with pytest.raises(ValueError, match="int8"):
        cpu_ops.pack_q8_panels(torch.zeros(16, 64))
    with pytest.raises(ValueError, match=r"\[-127, 127\]"):
        cpu_ops.pack_q8_panels(torch.full((16, 64), -128, dtype=torch.int8))


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 7, 9, 300])
@pytest.mark.parametrize(("out_features", "in_features"), Q8_SHAPES)
def test_q8_kernel_matches_reference(num_tokens, out_features, in_features):
    gen = torch.Generator().manual_seed(num_tokens * 7 + out_features)
    x = torch.randn(num_tokens, in_features, generator=gen)
    x[0, :INT8_GROUP] = 0.0  # an all-zero group: scale 0, q 0
    stored, scale, packed, packed_scale = q8_weight(out_features, in_features, gen)
    bias = torch.randn(out_features, generator=gen)
    got = torch.ops.skiff_cpu.linear_packed(x, packed, out_features, bias, packed_scale)
    assert got.shape == (num_tokens, out_features)
    want = q8_reference(x, stored, scale) + bias.double()
    # fp32 rounding of a sum of G terms: well under one quantization step of x or w
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-5)


def test_q8_differs_from_the_int8_kernel_by_quantizing_x():
    """The same int8 weights: W8A8 is not W8A32 (x is quantized), yet close to it."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 576, generator=gen)
    stored, scale, packed, packed_scale = q8_weight(130, 576, gen)
    q8 = torch.ops.skiff_cpu.linear_packed(x, packed, 130, None, packed_scale)
    int8 = torch.ops.skiff_cpu.linear(x, stored, None, scale)
    assert not torch.equal(q8, int8)
    torch.testing.assert_close(q8, int8, rtol=0.05, atol=0.05 * int8.abs().max().item())


@pytest.mark.parametrize(("out_features", "in_features"), [(130, 64), (962, 576), (50, 608)])
def test_q8_rows_are_bit_identical_in_any_batch(out_features, in_features):
    """x is quantized per row, and each output is one fp32 chain over the groups in order."""
    gen = torch.Generator().manual_seed(out_features)
    x = torch.randn(300, in_features, generator=gen)
    _, _, packed, scale = q8_weight(out_features, in_features, gen)

    def run(rows: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.skiff_cpu.linear_packed(
            rows, packed, out_features, None, scale
        )
        return out

    alone = torch.stack([run(row) for row in x])
    assert torch.equal(alone, run(x))
    for start, rows in [(0, 2), (3, 5), (7, 6), (11, 8), (1, 9), (2, 13), (5, 64), (40, 199)]:
        assert torch.equal(run(x[start : start + rows]), alone[start : start + rows]), (start, rows)


def test_q8_bits_match_across_instruction_sets():
    """VNNI and AVX2 compute the same exact int32 sums, then the same fp32 chains."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(23, 608, generator=gen) * 3
    _, _, packed, scale = q8_weight(100, 608, gen)
    here = torch.ops.skiff_cpu.linear_packed(x, packed, 100, None, scale)
    widest, ran = cpu_ops.isa(), set()
    for name in cpu_ops.ISAS:
        if cpu_ops.use_isa(name):
            ran.add(cpu_ops.int8_dot_isa())
            got = torch.ops.skiff_cpu.linear_packed(x, packed, 100, None, scale)
            assert torch.equal(got, here), name
    cpu_ops.use_isa(widest)
    assert "avx2" in ran


def test_int8_dot_isa_is_vnni_only_where_the_cpu_has_it():
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    vnni = {"avx512f", "avx512bw", "avx512_vnni"} <= set(flags)
    want = "avx512_vnni" if cpu_ops.isa() == "avx512" and vnni else "avx2"
    assert cpu_ops.int8_dot_isa() == want


def test_q8_panels_with_bad_shapes_or_scales_are_refused():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 64)
    _, scale, packed, packed_scale = q8_weight(20, 64, gen)
    with pytest.raises(RuntimeError, match="K % 32"):  # K = 48: not whole groups
        torch.ops.skiff_cpu.linear_packed(
            torch.randn(2, 48), torch.zeros(2, 12, 16, 4, dtype=torch.int8), 20, None,
            torch.ones(2, 1, 16),
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="linear_packed"):  # no scales
        torch.ops.skiff_cpu.linear_packed(x, packed, 20)
    with pytest.raises(RuntimeError, match="linear_packed"):  # row-major scales
        torch.ops.skiff_cpu.linear_packed(x, packed, 20, None, scale)
    with pytest.raises(RuntimeError, match="linear_packed"):  # x of another K
        torch.ops.skiff_cpu.linear_packed(torch.randn(2, 32), packed, 20, None, packed_scale)
    with pytest.raises(ValueError, match="in_features % 32"):
        quantize_int8(torch.randn(4, 48))


def test_ops_linear_routes_q8_panels_to_the_q8_kernel():
    gen = torch.Generator().manual_seed(3)
    x, bias = torch.randn(5, 64, generator=gen), torch.randn(24, generator=gen)
    stored, scale, packed, packed_scale = q8_weight(24, 64, gen)
    got = ops.linear(x, stored, bias, scale, packed, packed_scale)
    torch.testing.assert_close(
        got.double(), q8_reference(x, stored, scale) + bias.double(), rtol=1e-5, atol=2e-5
    )


# (tokens, in, slice outputs, rank, slots): an adapter's tokens over several 16-row shrink
# pieces, a slice's outputs over several 4-panel expand chunks and partial panels; ranks 8 and
# 16; one slice, GQA's q | k | v (uneven: 6 query heads, 2 KV heads), gate | up
LORA_SHAPES = [
    (1, 16, (24,), 16, 1),
    (70, 64, (130,), 8, 2),
    (45, 576, (96, 32, 32), 16, 3),
    (33, 64, (40, 24, 24), 8, 2),
    (9, 128, (200, 200), 16, 4),
]


def lora_case(tokens, in_features, sizes, rank, slots):
    """(y [T, N], x [T, K], lora_a [S, n R, K], each slice's B [S, N_i, R], int32 slots)."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, in_features, generator=gen)
    y = torch.randn(tokens, sum(sizes), generator=gen)
    lora_a = torch.randn(slots, len(sizes) * rank, in_features, generator=gen) / in_features**0.5
    bs = [torch.randn(slots, size, rank, generator=gen) for size in sizes]
    token_slots = torch.randint(-1, slots, (tokens,), generator=gen, dtype=torch.int32)
    return y, x, lora_a, bs, token_slots


def block_diagonal(bs: list[torch.Tensor]) -> torch.Tensor:
    """The slices' B [S, N_i, R] -> the fused projection's lora_b [S, N, n R]."""
    return torch.stack([torch.block_diag(*(b[s] for b in bs)) for s in range(bs[0].shape[0])])


def slice_panels(bs: list[torch.Tensor]) -> torch.Tensor:
    """The slices' B [S, N_i, R] -> add_lora's lora_b [S, sum(ceil(N_i / 16)), R, 16]."""
    return torch.cat([torch.stack([cpu_ops.pack_panels(b_s) for b_s in b]) for b in bs], dim=1)


@pytest.mark.parametrize(("tokens", "in_features", "sizes", "rank", "slots"), LORA_SHAPES)
def test_add_lora_matches_reference(tokens, in_features, sizes, rank, slots):
    y, x, lora_a, bs, token_slots = lora_case(tokens, in_features, sizes, rank, slots)
    dense = block_diagonal(bs)  # [S, N, n R]
    expected = torch_reference.add_lora(y.clone(), x, lora_a, dense, token_slots.long())
    panels = slice_panels(bs)
    got = y.clone()
    torch.ops.skiff_cpu.add_lora(got, x, lora_a, panels, token_slots, sizes)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    base = token_slots < 0
    assert torch.equal(got[base], y[base])  # untouched bits
    alone = y[:1].clone()  # a token's bits do not depend on the others
    torch.ops.skiff_cpu.add_lora(alone, x[:1], lora_a, panels, token_slots[:1].contiguous(), sizes)
    assert torch.equal(alone[0], got[0])


@pytest.mark.parametrize(("tokens", "in_features", "sizes", "rank", "slots"), LORA_SHAPES)
def test_add_lora_slices_give_the_block_diagonal_bits(tokens, in_features, sizes, rank, slots):
    """Per slice, the expand skips the zero blocks of the fused lora_b and nothing else: the
    bits of one slice over the whole block-diagonal matrix (its zero products add +0)."""
    y, x, lora_a, bs, token_slots = lora_case(tokens, in_features, sizes, rank, slots)
    whole = torch.stack([cpu_ops.pack_panels(b) for b in block_diagonal(bs)])  # [S, P, n R, 16]
    one, per_slice = y.clone(), y.clone()
    torch.ops.skiff_cpu.add_lora(one, x, lora_a, whole, token_slots, [sum(sizes)])
    torch.ops.skiff_cpu.add_lora(per_slice, x, lora_a, slice_panels(bs), token_slots, sizes)
    assert torch.equal(per_slice, one)


def test_add_lora_refuses_what_it_does_not_cover():
    x, y = torch.randn(2, 16), torch.randn(2, 8)
    a, b = torch.randn(1, 4, 16), torch.randn(1, 1, 4, 16)  # rank 4, one panel
    slots = torch.tensor([0, -1], dtype=torch.int32)
    for bad, match in (
        ((y, torch.randn(2, 8), torch.randn(1, 4, 8), b, slots, [8]), "multiple of 16"),
        ((y, x, a, b, torch.tensor([0, 1], dtype=torch.int32), [8]), "out of range"),
        ((y, x, a, b, slots.long(), [8]), "int32"),
        ((y, torch.randn(2, 32), a, b, slots, [8]), "lora_a"),
        ((y, x, a, torch.randn(1, 8, 4), slots, [8]), "panels|lora_b"),
        ((y, x, a, b, slots, [4, 4]), "n slices"),  # two slices need lora_a [S, 2 R, K]
        ((y, x, torch.randn(1, 8, 16), b, slots, [4, 4]), "panels"),  # a panel per slice
        ((y, x, a, b, slots, [6]), "add up"),
    ):
        with pytest.raises(RuntimeError, match=match):
            torch.ops.skiff_cpu.add_lora(*bad)
