"""The bf16 x bf16 kernel (`--cpu-weights bf16_dot`; kernels/csrc/bf16_bodies.h) against
the chain cpu_kernels.h defines, computed step by step in torch: x rounded to bf16, then per
pair of k the odd product added, then the even one, each sum rounded to fp32 (as AVX512-BF16's
vdpbf16ps does). Bit for bit, with every dot-product instruction set this CPU has (vdpbf16ps,
and the pairs widened to fp32 under AVX-512F and AVX2), in any batch."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kernels import cpu_ops, ops
from tests.cpu_isa import running_bf16_dot_isa

pytestmark = pytest.mark.unit

BF16_DOT_ISAS = ("avx512_bf16", "avx512", "avx2")  # cpu_ops.use_bf16_dot_isa's names
TINY = torch.finfo(torch.float32).tiny  # fp32's smallest normal value


@pytest.fixture(params=BF16_DOT_ISAS)
def dot_isa(request) -> Iterator[str]:
    """A test runs with each bf16 dot-product instruction set this CPU has."""
    with running_bf16_dot_isa(request.param) as name:
        yield name


def default_dot_isa() -> str:
    """What bf16_dot_isa() is on this CPU without a pick."""
    flags = cpu_flags()
    if cpu_ops.isa() == "avx512" and {"avx512f", "avx512bw", "avx512_bf16"} <= flags:
        return "avx512_bf16"
    return cpu_ops.isa()


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next(line for line in f if line.startswith("flags")).split()[2:])


def flushed(t: torch.Tensor) -> torch.Tensor:
    """Values below fp32's normal range as zero, sign kept."""
    return t * (t.abs() >= TINY)


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 -> what the kernel multiplies: bf16 to nearest even, subnormals zero."""
    return flushed(x.to(torch.bfloat16).float())


def reference(x: torch.Tensor, weight: torch.Tensor, flush: bool = True) -> torch.Tensor:
    """x [M, K] fp32 @ weight [N, K] bf16 ^T as cpu_kernels.h's chain: [M, N] fp32 (`flush`
    False: partial sums below the normal range kept). Each product of two bf16 values is
    exact in fp32 where it is not far below the normal range, so each step rounds once."""
    xb, w = rounded(x), flushed(weight.float())
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for j in range(0, x.shape[1], 2):
        for k in (j + 1, j):  # the odd product first
            acc = acc + xb[:, k : k + 1] * w[:, k]  # [M, N]
            acc = flushed(acc) if flush else acc
    return acc


def bf16_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 weight [n, k], its pair panels)."""
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    return weight, cpu_ops.pack_bf16_panels(weight)


def run(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    out: torch.Tensor = torch.ops.skiff_cpu.linear_packed(x, packed, n, None, None)
    return out


def test_bf16_panels_pack_pairs_of_k_side_by_side():
    weight = torch.randn(20, 64).to(torch.bfloat16)
    weight[17, 6] = 1e-39  # below fp32's normal range: read as zero
    packed = cpu_ops.pack_bf16_panels(weight)
    assert packed.shape == (2, 32, cpu_ops.PANEL, 2) and packed.dtype == torch.bfloat16
    assert torch.equal(packed[1, 5, 2], weight[18, 10:12])  # panel 1, pair 5, lane 2
    assert packed[1, 3, 1, 0] == 0 and weight[17, 6] != 0
    assert not packed[1, :, 4:].any()  # zero past N
    with pytest.raises(ValueError, match="even K"):
        cpu_ops.pack_bf16_panels(torch.zeros(16, 63, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        cpu_ops.pack_bf16_panels(torch.zeros(16, 64))


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 6, 7, 13, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(20, 64), (130, 576), (50, 1538)])
def test_bf16_kernel_is_the_vdpbf16ps_chain(dot_isa, num_tokens, out_features, in_features):
    gen = torch.Generator().manual_seed(num_tokens * 31 + out_features)
    x = torch.randn(num_tokens, in_features, generator=gen) * 4
    x[0, :5] = torch.tensor([1e-39, -1e-40, 0.0, -0.0, 3e38])  # subnormals read as zero
    weight, packed = bf16_weight(out_features, in_features, gen)
    got = run(x, packed, out_features)
    assert torch.equal(got, reference(x, weight)), dot_isa


def test_x_is_rounded_to_nearest_even(dot_isa):
    """Ties go to the even bf16: 1 + 2^-8 to 1, 1 + 3 2^-8 to 1 + 2^-6; a NaN makes its own
    row NaN and no other."""
    weight = torch.zeros(16, 4, dtype=torch.bfloat16)
    weight[0, 0] = weight[1, 1] = weight[2, 2] = 1.0
    x = torch.tensor([[1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, 0.0], [1, 2, 3, torch.nan]])
    got = run(x, cpu_ops.pack_bf16_panels(weight), 16)
    assert got[0, :3].tolist() == [1.0, 1 + 2**-6, 1 + 2**-7] and not got[0, 3:].any()
    assert got[1].isnan().all(), dot_isa


def test_sums_below_the_normal_range_flush_to_zero_in_every_instruction_set(dot_isa):
    """Products and partial sums around fp32's smallest normal (2^-126): vdpbf16ps flushes
    what falls below it; the widened kernels run with MXCSR's flush-to-zero bits set."""
    gen = torch.Generator().manual_seed(3)

    def around(shape: tuple[int, int], values: list[float], exponent: int) -> torch.Tensor:
        picks = torch.tensor(values)[torch.randint(len(values), shape, generator=gen)]
        signs = torch.randint(2, shape, generator=gen) * 2 - 1
        return picks * signs * 2.0**exponent

    x = around((5, 64), [1.0, 1.5, 3.0], -62)
    weight = around((40, 64), [1.0, 1.25, 2.5], -64).to(torch.bfloat16)  # products 2^-127..
    got = run(x, cpu_ops.pack_bf16_panels(weight), 40)
    want = reference(x, weight)
    assert torch.equal(got, want), dot_isa
    assert not torch.equal(want, reference(x, weight, flush=False))  # the flush mattered


@pytest.mark.parametrize(("out_features", "in_features"), [(130, 64), (962, 576)])
def test_bf16_rows_are_bit_identical_in_any_batch(out_features, in_features):
    """x is rounded per element, and each output is one fp32 chain over k in order."""
    gen = torch.Generator().manual_seed(out_features)
    x = torch.randn(300, in_features, generator=gen)
    _, packed = bf16_weight(out_features, in_features, gen)
    alone = torch.stack([run(row, packed, out_features) for row in x])
    assert torch.equal(alone, run(x, packed, out_features))
    for start, rows in [(0, 2), (3, 5), (7, 6), (11, 8), (1, 9), (2, 13), (40, 199)]:
        got = run(x[start : start + rows], packed, out_features)
        assert torch.equal(got, alone[start : start + rows]), (start, rows)


def test_bf16_dot_differs_from_the_bf16_kernel_by_rounding_x():
    """The same bf16 weights: W16A16 is not W16A32 (x is rounded), yet close to it."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 576, generator=gen)
    weight, packed = bf16_weight(130, 576, gen)
    dot = run(x, packed, 130)
    fp32_x = torch.ops.skiff_cpu.linear(x, weight, None, None)
    assert not torch.equal(dot, fp32_x)
    torch.testing.assert_close(dot, fp32_x, rtol=0.02, atol=0.02 * fp32_x.abs().max().item())


def test_bf16_dot_isa_is_avx512_bf16_only_where_the_cpu_has_it():
    assert cpu_ops.bf16_dot_isa() == default_dot_isa()
    assert cpu_ops.use_bf16_dot_isa("avx512_bf16") == (default_dot_isa() == "avx512_bf16")
    assert not cpu_ops.use_bf16_dot_isa("sse2")
    assert cpu_ops.use_bf16_dot_isa(default_dot_isa())
    assert cpu_ops.bf16_dot_isa() == default_dot_isa()


def test_bf16_pair_panels_with_scales_or_bad_shapes_are_refused():
    gen = torch.Generator().manual_seed(2)
    _, packed = bf16_weight(20, 64, gen)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="bf16 pair panels"):  # int8-like scales
        torch.ops.skiff_cpu.linear_packed(x, packed, 20, None, torch.ones(2, 2, 16))
    with pytest.raises(RuntimeError, match="bf16 pair panels"):  # 3 panels for 20 outputs
        torch.ops.skiff_cpu.linear_packed(x, torch.cat([packed, packed[:1]]), 20, None, None)
    with pytest.raises(RuntimeError, match="bf16 pair panels"):  # x of another K
        torch.ops.skiff_cpu.linear_packed(torch.randn(2, 48), packed, 20, None, None)


def test_ops_linear_routes_bf16_pair_panels_to_the_bf16_kernel():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 64, generator=gen)
    weight, packed = bf16_weight(20, 64, gen)
    bias = torch.randn(20, generator=gen)
    got = ops.linear(x, weight.to("meta"), bias, None, packed)
    assert torch.equal(got, reference(x, weight) + bias)
