"""LoRA: the Triton shrink/expand kernels (kernels/lora.py) and ops.add_lora's grouped torch
path against reference.add_lora (one token at a time).

Without a GPU the kernels run in Triton's CPU interpreter on CPU tensors (shapes kept small);
with TRITON_INTERPRET=0 on a CUDA machine the same tests run on the GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Iterator

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from kernels import lora, ops, reference
from kernels._checks import interpreting
from kernels.lora_mapping import NO_LORA, LoRAMapping

INTERPRET = interpreting()
if INTERPRET and not isinstance(lora._shrink_kernel, InterpretedFunction):
    raise RuntimeError("Triton was imported before TRITON_INTERPRET=1 was set")
needs_triton = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="TRITON_INTERPRET=0 and no CUDA"
)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=TOL[dtype] * 4, rtol=TOL[dtype]
    )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs included)."""
    return a.dtype == b.dtype and torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


def make_lora(
    num_tokens: int,
    in_features: int,
    out_features: int,
    rank: int,
    num_slots: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device = DEVICE,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, x, lora_a, lora_b, token_lora_indices): updates of about the size of y, every slot
    used where the tokens allow it, about a quarter of the tokens (and the last one, where
    there are more tokens than slots) without an adapter."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=gen)  # [t, in]
    y = torch.randn(num_tokens, out_features, generator=gen)  # [t, out]
    lora_a = torch.randn(num_slots, rank, in_features, generator=gen) / in_features**0.5
    lora_b = torch.randn(num_slots, out_features, rank, generator=gen) / rank**0.5
    indices = torch.randint(-1, num_slots, (num_tokens,), generator=gen)
    indices[torch.rand(num_tokens, generator=gen) < 0.25] = NO_LORA
    indices[: min(num_slots, num_tokens)] = torch.arange(min(num_slots, num_tokens))
    if num_tokens > num_slots:
        indices[-1] = NO_LORA
    tensors = (y, x, lora_a, lora_b)
    y, x, lora_a, lora_b = (t.to(device=device, dtype=dtype) for t in tensors)
    return y, x, lora_a, lora_b, indices.to(device)


def run_reference(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    return reference.add_lora(y.clone(), x, a, b, idx)


def add_lora_fp64(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    """The exact update in fp64 (y's rows of slot -1 as they are), not rounded to y.dtype."""
    out = y.double()
    for t, slot in enumerate(idx.tolist()):
        if slot >= 0:
            out[t] += b[slot].double() @ (a[slot].double() @ x[t].double())
    return out


# --- Triton kernels --------------------------------------------------------------------------


# (num_tokens, in, out, rank, num_slots): ranks 8..64 in one rank block, 12 masked, 100 over
# two rank programs in the shrink and two rank steps in the expand; in/out over several tiles,
# in over 2 (1024) and 3 (1100, the last partial) split-K slices
SHAPES = [
    (1, 64, 48, 8, 1),
    (2, 1024, 40, 8, 1),
    (3, 1100, 64, 16, 2),
    (9, 200, 300, 12, 3),
    (12, 128, 96, 16, 4),
    (5, 300, 130, 32, 2),
    (6, 96, 72, 64, 2),
    (4, 40, 20, 100, 2),
]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "t{}-in{}-out{}-r{}-s{}".format(*s))
def test_triton_matches_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    y, x, lora_a, lora_b, indices = make_lora(*shape, dtype=dtype)
    before = y.clone()
    got = lora.add_lora(y, x, lora_a, lora_b, indices)
    assert got is y
    assert_close(y, run_reference(before, x, lora_a, lora_b, indices), dtype)
    none = indices == NO_LORA
    assert same_bits(y[none], before[none])
    assert not torch.equal(y[~none], before[~none])
    if dtype != torch.float32:  # fp32 sums, one rounding into y: within an ulp of exact
        exact = add_lora_fp64(before, x, lora_a, lora_b, indices)
        eps = torch.finfo(dtype).eps
        assert bool(((y.double() - exact).abs() <= eps * exact.abs() + 1e-6).all())


@needs_triton
def test_triton_strided_operands() -> None:
    """Adapters as the first `rank` rows / columns of max-rank stacks (non-contiguous per
    slot), strided x rows, y a column slice of a fused output, int32 indices."""
    num_tokens, in_features, out_features, rank, max_rank = 7, 72, 40, 12, 32
    y, x, lora_a, lora_b, indices = make_lora(num_tokens, in_features, out_features, rank, 3)
    a_stack = torch.zeros(4, max_rank, in_features, device=DEVICE)  # [max_loras, max_rank, in]
    b_stack = torch.zeros(4, out_features, max_rank, device=DEVICE)  # [max_loras, out, max_rank]
    a_stack[1:, :rank], b_stack[1:, :, :rank] = lora_a, lora_b
    strided_a, strided_b = a_stack[1:, :rank], b_stack[1:, :, :rank]
    assert not strided_b.is_contiguous()
    x_wide = torch.randn(num_tokens, 100, device=DEVICE)
    x_wide[:, 10 : 10 + in_features] = x
    fused = torch.randn(num_tokens, 3 * out_features, device=DEVICE)  # [t, q | k | v]
    fused[:, out_features : 2 * out_features] = y
    before = fused.clone()
    lora.add_lora(
        fused[:, out_features : 2 * out_features],
        x_wide[:, 10 : 10 + in_features],
        strided_a,
        strided_b,
        indices.to(torch.int32),
    )
    expected = run_reference(y, x, lora_a, lora_b, indices)
    assert_close(fused[:, out_features : 2 * out_features], expected, torch.float32)
    assert torch.equal(fused[:, :out_features], before[:, :out_features])
    assert torch.equal(fused[:, 2 * out_features :], before[:, 2 * out_features :])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_skips_tokens_without_adapter(dtype: torch.dtype) -> None:
    """Rows of slot -1 are neither read nor written: NaN in their x and y stays NaN, with
    its bits, and the other rows stay finite."""
    y, x, lora_a, lora_b, _ = make_lora(6, 48, 40, 8, 2, dtype=dtype)
    indices = torch.tensor([NO_LORA, 0, NO_LORA, 1, 1, NO_LORA], device=DEVICE)
    none = indices == NO_LORA
    x[none], y[none] = float("nan"), float("nan")
    before = y.clone()
    lora.add_lora(y, x, lora_a, lora_b, indices)
    assert same_bits(y[none], before[none])
    assert bool(y[~none].isfinite().all())
    after = y.clone()
    lora.add_lora(y, x, lora_a, lora_b, torch.full_like(indices, NO_LORA))
    assert same_bits(y, after)


@needs_triton
def test_triton_token_bits_independent_of_batch() -> None:
    """One program per token: each token's row has the same bits alone as in a mixed call."""
    y, x, lora_a, lora_b, indices = make_lora(8, 96, 80, 16, 3, dtype=torch.float16)
    batched = lora.add_lora(y.clone(), x, lora_a, lora_b, indices)
    for t in range(len(indices)):
        alone = lora.add_lora(
            y[t : t + 1].clone(), x[t : t + 1], lora_a, lora_b, indices[t : t + 1]
        )
        assert same_bits(alone[0], batched[t]), t


@needs_triton
def test_triton_empty() -> None:
    y, x, lora_a, lora_b, indices = make_lora(0, 16, 16, 8, 2)
    assert lora.add_lora(y, x, lora_a, lora_b, indices).shape == (0, 16)
    y, x, lora_a, lora_b, indices = make_lora(3, 16, 16, 8, 0)
    before = y.clone()
    lora.add_lora(y, x, lora_a, lora_b, torch.full_like(indices, NO_LORA))
    assert torch.equal(y, before)


@needs_triton
def test_triton_bad_arguments() -> None:
    y, x, lora_a, lora_b, indices = make_lora(4, 32, 24, 8, 2)
    cases = [
        ((y, x, lora_a, lora_b, indices.float()), "dtype"),
        ((y, x.to(torch.int32), lora_a, lora_b, indices), "dtype"),
        ((y, x[:, :16], lora_a, lora_b, indices), "lora_a: expected shape"),
        ((y, x, lora_a, lora_b[:, :, :4], indices), "lora_b: expected shape"),
        ((y[:, :20], x, lora_a, lora_b, indices), "lora_b: expected shape"),
        ((y, x[:3], lora_a, lora_b, indices), "x: expected shape"),
        ((y, x, lora_a, lora_b, indices[:3]), "token_lora_indices: expected shape"),
        ((y, x, lora_a[0], lora_b, indices), "lora_a: expected 3 dims"),
        ((y.t().contiguous().t(), x, lora_a, lora_b, indices), "y: last dim must have stride"),
        (
            (y, x, lora_a.transpose(1, 2).contiguous().transpose(1, 2), lora_b, indices),
            "lora_a: last",
        ),
        ((y, x, lora_a, lora_b, indices.view(2, 2)), "token_lora_indices: expected 1 dims"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            lora.add_lora(*args)


# --- ops.add_lora: dispatch and the grouped torch path ----------------------------------------


@pytest.fixture
def triton_on_cpu() -> Iterator[None]:
    ops.use_triton_on_cpu(True)
    yield
    ops.use_triton_on_cpu(False)


class _Spy:
    """Stands in for a @triton.jit kernel and counts its launches."""

    def __init__(self, kernel: object) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid: tuple[int, ...]):
        self.launches += 1
        return self.kernel[grid]


@needs_triton
def test_ops_dispatch(monkeypatch: pytest.MonkeyPatch, triton_on_cpu: None) -> None:
    spy = _Spy(lora._shrink_kernel)
    monkeypatch.setattr(lora, "_shrink_kernel", spy)
    y, x, lora_a, lora_b, indices = make_lora(5, 32, 24, 8, 2)
    mapping = LoRAMapping.build(indices)
    expected = run_reference(y, x, lora_a, lora_b, indices)
    got = ops.add_lora(y.clone(), x, lora_a, lora_b, mapping)
    assert_close(got, expected, torch.float32)
    assert spy.launches == 1
    none = LoRAMapping.build(torch.full_like(indices, NO_LORA))
    assert same_bits(ops.add_lora(y.clone(), x, lora_a, lora_b, none), y)
    assert spy.launches == 1  # nothing to launch for a step without adapters
    if DEVICE.type == "cpu":
        ops.use_triton_on_cpu(False)
        cpu = ops.add_lora(y.clone(), x, lora_a, lora_b, mapping)
        assert spy.launches == 1  # CPU tensors take the grouped torch path by default
        assert_close(cpu, expected, torch.float32)


# bf16 / fp16 matmuls on the CPU round their products' sums to the dtype, twice (shrink and
# expand): a looser tolerance than the one-rounding kernels
CPU_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16, 24, 8, 1), (17, 64, 48, 12, 4), (9, 96, 40, 64, 3)])
def test_cpu_path_matches_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    cpu = torch.device("cpu")
    y, x, lora_a, lora_b, indices = make_lora(*shape, dtype=dtype, device=cpu)
    before = y.clone()
    expected = run_reference(y, x, lora_a, lora_b, indices)
    ops.add_lora(y, x, lora_a, lora_b, LoRAMapping.build(indices))
    torch.testing.assert_close(
        y.float(), expected.float(), atol=CPU_TOL[dtype] * 4, rtol=CPU_TOL[dtype]
    )
    none = indices == NO_LORA
    assert same_bits(y[none], before[none])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_path_token_bits_independent_of_other_adapters(dtype: torch.dtype) -> None:
    """Slot 0's tokens get the same bits whether or not tokens of other adapters share the
    call, and whether or not base-model tokens sit between them."""
    cpu = torch.device("cpu")
    y, x, lora_a, lora_b, _ = make_lora(12, 64, 48, 16, 3, dtype=dtype, device=cpu)
    indices = torch.tensor([0, 1, 2, 0, -1, 1, 0, 0, 2, -1, 0, 1])
    mine = indices == 0
    mixed = ops.add_lora(y.clone(), x, lora_a, lora_b, LoRAMapping.build(indices))
    alone_idx = torch.where(mine, indices, NO_LORA)
    alone = ops.add_lora(y.clone(), x, lora_a, lora_b, LoRAMapping.build(alone_idx))
    assert same_bits(mixed[mine], alone[mine])
    rows = ops.add_lora(y[mine].clone(), x[mine], lora_a, lora_b, LoRAMapping.build(indices[mine]))
    assert same_bits(mixed[mine], rows)
