"""Every Triton kernel against its plain-torch reference.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here before
Triton is imported), on CPU tensors; shapes are kept small because the interpreter is slow.
With TRITON_INTERPRET=0 on a CUDA machine the same tests run on the GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.metadata
import importlib.util
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from kernels import activation, ops, reference
from kernels import kv_cache as kv_kernels
from kernels import paged_attention as pa
from kernels import rms_norm as rms_kernels
from kernels import rotary as rotary_kernels
from kernels._checks import interpreting

INTERPRET = interpreting()
if INTERPRET and not isinstance(pa._paged_attention_kernel, InterpretedFunction):
    raise RuntimeError(
        "Triton was imported before TRITON_INTERPRET=1 was set (it is read when kernels are "
        "decorated): tests/conftest.py must set it first"
    )
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no CUDA device", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
BLOCK_SIZE = 16
# The interpreter keeps bf16 as raw uint16 in tl.dot and arithmetic: bf16 only where the
# kernel computes in fp32, and never through tl.dot there.
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DOT_DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(
        actual.float(), expected.float(), atol=TOL[dtype] * 4, rtol=TOL[dtype]
    )


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


# --- elementwise kernels -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,d", [(0, 8), (1, 1), (3, 13), (2, 1100)])
def test_silu_and_mul(dtype: torch.dtype, num_tokens: int, d: int) -> None:
    x = randn(num_tokens, 2 * d, dtype=dtype)  # [num_tokens, 2 * d]
    assert_close(activation.silu_and_mul(x), reference.silu_and_mul(x), dtype)


def test_silu_and_mul_strided_rows() -> None:
    x = randn(5, 40)[:, :26]  # row stride 40, not 26
    assert_close(activation.silu_and_mul(x), reference.silu_and_mul(x), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 33, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    x = randn(5, hidden, dtype=dtype)  # [num_tokens, hidden]
    residual = randn(5, hidden, dtype=dtype) if with_residual else None
    weight = 1 + 0.1 * randn(hidden, dtype=dtype)
    normed, new_residual = rms_kernels.rms_norm(x, weight, 1e-6, residual)
    ref_normed, ref_residual = reference.rms_norm(x, weight, 1e-6, residual)
    assert_close(normed, ref_normed, dtype)
    assert_close(new_residual, ref_residual, dtype)
    if residual is None:
        assert new_residual is x


def test_rms_norm_mixed_dtypes_and_strides() -> None:
    x = randn(4, 100, dtype=torch.float16)[:, :37]  # row stride 100
    residual = randn(4, 37, dtype=torch.float16)
    weight = randn(37)  # fp32 weight promotes the output, as in torch
    got = rms_kernels.rms_norm(x, weight, 1e-5, residual)
    want = reference.rms_norm(x, weight, 1e-5, residual)
    assert got[0].dtype == torch.float32
    assert_close(got[0], want[0], torch.float16)
    assert_close(got[1], want[1], torch.float16)
    assert rms_kernels.rms_norm(x[:0], weight, 1e-5)[0].shape == (0, 37)


def test_other_ranks_like_the_reference() -> None:
    x = randn(2, 3, 10)  # [batch, heads, 2 * d]: e.g. per-head q/k norm inputs
    assert_close(activation.silu_and_mul(x), reference.silu_and_mul(x), torch.float32)
    weight, residual = randn(10), randn(2, 3, 10)
    for res in (None, residual):
        got = rms_kernels.rms_norm(x, weight, 1e-6, res)
        want = reference.rms_norm(x, weight, 1e-6, res)
        assert_close(got[0], want[0], torch.float32)
        assert_close(got[1], want[1], torch.float32)


def llama3_cos_sin_cache(rot_dim: int, max_position: int, base: float = 500000.0) -> torch.Tensor:
    """cos | sin cache with llama3 frequency scaling baked in, as the model builds it."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    factor, low, high, old_len = 8.0, 1.0, 4.0, 8192
    wavelen = 2 * torch.pi / inv_freq
    smooth = ((old_len / wavelen) - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    scaled = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), scaled)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float().to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,rot_dim",
    [(4, 2, 64, 64), (2, 1, 128, 128), (3, 3, 80, 80), (4, 1, 80, 32)],
)
def test_rotary_embedding(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, rot_dim: int
) -> None:
    num_tokens, q_size, kv_size = 7, num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size, dtype=dtype)  # fused projection output
    query = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)  # strided views
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    cache = llama3_cos_sin_cache(rot_dim, 4096)  # [max_position, rot_dim]
    positions = torch.tensor([0, 1, 2, 17, 900, 4095, 3], device=DEVICE)
    got = rotary_kernels.rotary_embedding(positions, query, key, cache)
    want = reference.rotary_embedding(positions, query, key, cache)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, dtype)


def test_rotary_int32_positions_and_empty() -> None:
    query, key = randn(3, 2, 16), randn(3, 1, 16)
    cache = llama3_cos_sin_cache(16, 64)
    positions = torch.tensor([5, 0, 63], dtype=torch.int32, device=DEVICE)
    got = rotary_kernels.rotary_embedding(positions, query, key, cache)
    want = reference.rotary_embedding(positions.long(), query, key, cache)
    assert_close(got[0], want[0], torch.float32)
    assert_close(got[1], want[1], torch.float32)
    empty = rotary_kernels.rotary_embedding(positions[:0], query[:0], key[:0], cache)
    assert empty[0].shape == (0, 2, 16)


# --- KV cache write ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (1, 80), (3, 128)])
def test_write_kv_cache(
    dtype: torch.dtype, slot_dtype: torch.dtype, num_kv_heads: int, head_dim: int
) -> None:
    num_tokens, num_blocks = 9, 4
    kv = randn(num_tokens, 3, num_kv_heads, head_dim, dtype=dtype)  # [t, q|k|v, heads, dim]
    key, value = kv[:, 1], kv[:, 2]  # non-contiguous token stride, like a fused qkv split
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens are skipped
    cache = randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype)
    expected = cache.clone()
    kv_kernels.write_kv_cache(key, value, cache, slots.to(slot_dtype))
    reference.write_kv_cache(key, value, expected, slots)
    assert torch.equal(cache, expected)


def test_write_kv_cache_empty_and_all_padding() -> None:
    cache = randn(2, 2, BLOCK_SIZE, 1, 16)
    before = cache.clone()
    kv_kernels.write_kv_cache(randn(0, 1, 16), randn(0, 1, 16), cache, cache.new_zeros(0).long())
    slots = torch.full((3,), -1, dtype=torch.int64, device=DEVICE)
    kv_kernels.write_kv_cache(randn(3, 1, 16), randn(3, 1, 16), cache, slots)
    assert torch.equal(cache, before)


# --- paged attention -----------------------------------------------------------------------


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    num_valid: int  # query rows before the padding
    max_query_len: int
    max_seq_len: int


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    num_padding: int = 0,
    seed: int = 0,
) -> Batch:
    """Requests with q_lens new tokens at the end of seq_lens contexts, in scattered blocks."""
    torch.manual_seed(seed)
    blocks_per_req = [-(-s // BLOCK_SIZE) for s in seq_lens]
    max_blocks = max(blocks_per_req, default=0) + 1  # a spare column: rows are padded
    num_blocks = sum(blocks_per_req) + 3
    ids = torch.randperm(num_blocks)  # scattered, not in request order
    table = torch.zeros(len(q_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_req):
        table[i, :n] = ids[used : used + n]
        used += n
    qsl = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()])
    num_valid = int(qsl[-1])
    return Batch(
        query=randn(num_valid + num_padding, num_heads, head_dim, dtype=dtype),
        kv_cache=randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype),
        query_start_loc=qsl.to(torch.int32).to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_table=table.to(DEVICE),
        num_valid=num_valid,
        max_query_len=max(q_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )


def check_attention(batch: Batch, dtype: torch.dtype = torch.float32, **kwargs: int) -> None:
    args = (batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table)
    scale = batch.query.shape[-1] ** -0.5
    got = pa.paged_attention(*args, scale, **kwargs)[: batch.num_valid]
    want = reference.paged_attention(*args, scale)[: batch.num_valid]
    assert_close(got, want, dtype)


# q_lens / seq_lens: a prefill chunk starting mid-block (context 5), a whole prompt, decode
# tokens (one with a context spanning many blocks), an idle request (q_len 0).
MIXED = ([13, 1, 0, 20, 1], [18, 70, 9, 20, 181])


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(4, 2, 64), (2, 1, 128), (3, 1, 80), (2, 2, 80)]
)
def test_paged_attention_mixed_batch(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    batch = make_batch(*MIXED, num_heads, num_kv_heads, head_dim, num_padding=3)
    check_attention(batch, max_query_len=batch.max_query_len)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_paged_attention_dtypes(dtype: torch.dtype) -> None:
    check_attention(make_batch(*MIXED, 4, 2, 64, dtype=dtype), dtype)


def test_paged_attention_empty_decode_set() -> None:
    """Prefill chunks only: one starting mid-block, one at a block boundary, one spanning
    several blocks in a single chunk."""
    batch = make_batch([3, 16, 37], [10, 48, 37], 2, 1, 64)
    check_attention(batch)


def test_paged_attention_decode_only_with_splits() -> None:
    # trailing idle requests and padding rows, as a CUDA-graph-sized batch has them
    batch = make_batch([1, 1, 1, 1, 0, 0], [1, 17, 200, 33, 0, 0], 4, 1, 64, num_padding=2)
    for num_splits in (1, 3):
        check_attention(batch, max_query_len=1, max_seq_len=200, num_splits=num_splits)


def test_paged_attention_splits_in_mixed_batch() -> None:
    batch = make_batch([6, 1], [6, 90], 2, 2, 80)
    check_attention(batch, num_splits=4, tile_n=16)  # more splits than a short request needs


@pytest.mark.parametrize("block_m,tile_n", [(16, 16), (32, 64)])
def test_paged_attention_tilings(block_m: int, tile_n: int) -> None:
    """Tiles of several query tokens x heads, key tiles larger or smaller than a block."""
    batch = make_batch([9, 2, 17], [30, 40, 17], 6, 2, 64)
    check_attention(batch, block_m=block_m, tile_n=tile_n)


def test_paged_attention_long_prefill() -> None:
    """A 2k-token prefill chunk after 300 cached tokens with grouped-query heads: programs of
    BLOCK_Q tokens walk up to 37 key tiles (an online softmax over all of them)."""
    batch = make_batch([2048], [2348], 4, 2, 64)
    check_attention(batch, max_query_len=2048, max_seq_len=2348)


def test_paged_attention_no_requests() -> None:
    batch = make_batch([], [], 2, 1, 64, num_padding=2)
    check_attention(batch)


@pytest.mark.parametrize("seed", range(4))
def test_paged_attention_random(seed: int) -> None:
    rng = random.Random(seed)
    num_kv_heads, group = rng.choice([1, 2]), rng.choice([1, 2, 3, 4])
    head_dim = rng.choice([16, 64, 80, 96, 128])
    q_lens, seq_lens = [], []
    for _ in range(rng.randint(1, 4)):
        q_len = rng.choice([0, 1, 1, rng.randint(2, 24)])
        q_lens.append(q_len)
        seq_lens.append(q_len + rng.choice([0, rng.randint(1, 60)]))
    batch = make_batch(q_lens, seq_lens, num_kv_heads * group, num_kv_heads, head_dim, seed=seed)
    check_attention(batch, num_splits=rng.choice([1, 2]))


def test_paged_attention_bad_layout() -> None:
    batch = make_batch([2], [2], 2, 2, 64)
    args = (batch.query_start_loc, batch.seq_lens, batch.block_table, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        pa.paged_attention(randn(2, 3, 64), batch.kv_cache, *args)
    with pytest.raises(ValueError, match="dtype"):
        pa.paged_attention(batch.query.half(), batch.kv_cache, *args)
    with pytest.raises(ValueError, match="stride"):
        pa.paged_attention(
            batch.query.transpose(0, 2).contiguous().transpose(0, 2), batch.kv_cache, *args
        )


# --- backend, dispatch, interpreter ----------------------------------------------------------


def test_triton_backend_matches_reference() -> None:
    from services.worker.attention.base import AttentionMetadata
    from services.worker.attention.triton_backend import TritonAttentionBackend

    batch = make_batch([5, 1], [21, 40], 4, 2, 64)
    num_tokens = batch.query.shape[0]
    key, value = randn(num_tokens, 2, 64), randn(num_tokens, 2, 64)
    slots = torch.stack([_slot(batch, 0, p) for p in range(16, 21)] + [_slot(batch, 1, 39)])
    meta = AttentionMetadata(
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        slot_mapping=slots,
        max_query_len=5,
        max_seq_len=40,
    )
    expected_cache = batch.kv_cache.clone()
    got = TritonAttentionBackend().forward(batch.query, key, value, batch.kv_cache, meta, 0.125)
    reference.write_kv_cache(key, value, expected_cache, slots)
    assert torch.equal(batch.kv_cache, expected_cache)
    args = (batch.query_start_loc, batch.seq_lens, batch.block_table, 0.125)
    assert_close(got, reference.paged_attention(batch.query, expected_cache, *args), torch.float32)


def _slot(batch: Batch, req: int, pos: int) -> torch.Tensor:
    return (batch.block_table[req, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).long()


def test_cuda_device_selects_triton_backend() -> None:
    from services.worker.attention import get_attention_backend
    from services.worker.attention.triton_backend import TritonAttentionBackend

    assert isinstance(get_attention_backend(torch.device("cuda")), TritonAttentionBackend)


class _Spy:
    """Stands in for a @triton.jit kernel and records the devices of its tensor arguments."""

    def __init__(self, kernel: object) -> None:
        self.kernel, self.devices = kernel, []

    def __getitem__(self, grid: tuple[int, ...]):
        launch = self.kernel[grid]

        def run(*args: object, **kwargs: object) -> object:
            self.devices += [a.device.type for a in args if isinstance(a, torch.Tensor)]
            return launch(*args, **kwargs)

        return run


@pytest.fixture
def triton_on_cpu() -> Iterator[None]:
    ops.use_triton_on_cpu(True)
    yield
    ops.use_triton_on_cpu(False)


def test_ops_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(activation._silu_and_mul_kernel)
    monkeypatch.setattr(activation, "_silu_and_mul_kernel", spy)
    x = randn(2, 8)
    ops.silu_and_mul(x)  # CPU tensors take the reference by default
    assert spy.devices == ([] if x.device.type == "cpu" else ["cuda", "cuda"])
    ops.use_triton_on_cpu(True)
    try:
        assert_close(ops.silu_and_mul(x), reference.silu_and_mul(x), torch.float32)
    finally:
        ops.use_triton_on_cpu(False)
    assert spy.devices
    if INTERPRET:  # the interpreter runs the kernel on CPU tensors
        assert set(spy.devices) == {"cpu"}


@pytest.mark.usefixtures("triton_on_cpu")
def test_ops_triton_on_cpu_runs_every_kernel() -> None:
    batch = make_batch([3, 1], [3, 20], 2, 1, 64)
    args = (batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table)
    assert_close(
        ops.paged_attention(*args, 0.1), reference.paged_attention(*args, 0.1), torch.float32
    )
    x, w = randn(3, 24), randn(24)
    assert_close(
        ops.rms_norm(x, w, 1e-6, x)[0], reference.rms_norm(x, w, 1e-6, x)[0], torch.float32
    )
    cache = llama3_cos_sin_cache(64, 32)
    pos = torch.tensor([0, 5, 31, 7], device=DEVICE)
    q, k = randn(4, 2, 64), randn(4, 1, 64)
    assert_close(
        ops.rotary_embedding(pos, q, k, cache)[0],
        reference.rotary_embedding(pos, q, k, cache)[0],
        torch.float32,
    )
    kv_cache = batch.kv_cache.clone()
    slots = torch.tensor([3, -1, 40, 17], device=DEVICE)
    ops.write_kv_cache(k, k, kv_cache, slots)
    reference.write_kv_cache(k, k, batch.kv_cache, slots)
    assert torch.equal(kv_cache, batch.kv_cache)


def test_kernels_run_in_interpreter_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if not INTERPRET:
        pytest.skip("interpreter off")
    assert isinstance(pa._paged_attention_kernel, InterpretedFunction)
    assert DEVICE.type == "cpu"
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors need the interpreter
    assert not ops.use_triton(randn(2))
    with pytest.raises(ValueError, match="CUDA"):
        activation.silu_and_mul(randn(2, 8))


def test_not_mistaken_for_hf_kernels_package() -> None:
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("kernels")


def test_kernels_compile_for_sm90() -> None:
    """The interpreter does not compile: run the real compiler for Hopper, no GPU needed."""
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("Triton without its NVIDIA backend")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    cmd = [sys.executable, "-m", "kernels.compile_check", "--arch", "90"]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("registers") == 36
