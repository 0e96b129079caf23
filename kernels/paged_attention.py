"""Paged attention for mixed batches as a Triton kernel; see reference.paged_attention.

One launch serves prefill chunks and decode tokens together. Each program owns one KV head and
a tile of BLOCK_Q consecutive query tokens of one request; its BLOCK_M rows are those tokens
times the GROUP query heads that share the KV head (grouped-query attention), so every key and
value tile read from the cache is used by all of them.

Programs are numbered without host work: request i starts at program
`query_start_loc[i] // BLOCK_Q + i`, which leaves room for its cdiv(q_len, BLOCK_Q) tiles, so the
grid `num_tokens // BLOCK_Q + num_reqs` covers every request and a program finds its request by
binary search over `query_start_loc` (spare programs exit at once). With BLOCK_Q == 1 (decode
batches) request i starts at program `query_start_loc[i]` and the grid is just num_tokens.

Keys are read in tiles of TILE_N positions gathered through the block table, so TILE_N need
not equal the cache's block size. With NUM_SPLITS > 1 (flash-decoding) the key range of each
program is cut into NUM_SPLITS parts that run in parallel and a second kernel merges their
partial results by log-sum-exp; this keeps the GPU busy for small decode batches with long
contexts. The result does not depend on NUM_SPLITS, so a captured CUDA graph stays correct
whatever the sequence lengths at replay.
"""

from __future__ import annotations

import functools
import math

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kernels._checks import INDEX_DTYPES, check, check_device, check_shape

LOG2E = 1.4426950408889634
MAX_SPLITS = 16


@triton.jit  # type: ignore[untyped-decorator]
def _find_request(
    query_start_loc_ptr: tl.tensor, num_reqs: tl.tensor, q_block: tl.tensor, BLOCK_Q: tl.constexpr
) -> tl.tensor:
    """The last request i whose first program (see the module docstring) is <= q_block."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q
        if BLOCK_Q > 1:
            first_block += mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_reqs"])  # type: ignore[untyped-decorator]
def _paged_attention_kernel(
    out_ptr: tl.tensor,  # [num_tokens, num_heads, head_dim], or partials [NUM_SPLITS, ...] fp32
    lse_ptr: tl.tensor,  # [NUM_SPLITS, num_tokens, num_heads] fp32 (only with NUM_SPLITS > 1)
    query_ptr: tl.tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache_ptr: tl.tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc_ptr: tl.tensor,  # [num_reqs + 1]
    seq_lens_ptr: tl.tensor,  # [num_reqs]
    block_table_ptr: tl.tensor,  # [num_reqs, max_blocks]
    scale_log2: tl.tensor,  # softmax scale * log2(e)
    num_reqs: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    stride_split: tl.tensor,
    stride_lse_split: tl.tensor,
    stride_lse_t: tl.tensor,
    stride_kv: tl.tensor,
    stride_block: tl.tensor,
    stride_offset: tl.tensor,
    stride_head: tl.tensor,
    stride_table: tl.tensor,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
) -> None:
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = _find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_block = q_block - q_start // BLOCK_Q
    if BLOCK_Q > 1:
        local_block -= req
    if local_block * BLOCK_Q >= q_len:
        return
    context_len = tl.load(seq_lens_ptr + req) - q_len  # tokens cached before the new ones

    rows = tl.arange(0, BLOCK_M)
    q_idx = local_block * BLOCK_Q + rows // GROUP  # [BLOCK_M] token index within the request
    heads = kv_head * GROUP + rows % GROUP  # [BLOCK_M]
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context_len + q_idx  # [BLOCK_M] absolute position: attends keys 0..q_pos
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    tokens = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        query_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]

    kv_len = context_len + tl.minimum(q_len, (local_block + 1) * BLOCK_Q)  # keys this tile needs
    num_tiles = tl.cdiv(kv_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table_row = block_table_ptr + req.to(tl.int64) * stride_table
    head_off = kv_head * stride_head
    for tile in range(tile_lo, tile_hi):
        n = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] key positions
        n_ok = n < kv_len
        block = tl.load(table_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_off = block * stride_block + (n % BLOCK_SIZE) * stride_offset + head_off  # [TILE_N]
        kv_mask = n_ok[None, :] & dim_ok[:, None]
        k = tl.load(kv_cache_ptr + kv_off[None, :] + dims[:, None], mask=kv_mask, other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
        s = tl.where(n_ok[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            kv_cache_ptr + stride_kv + kv_off[:, None] + dims[None, :],
            mask=n_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_DIM_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows without keys: padding, or an empty split
    out = acc / l_safe[:, None]
    out_off = tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    out_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptr + split * stride_split + out_off, out, mask=out_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        lse_off = split * stride_lse_split + tokens * stride_lse_t + heads
        tl.store(lse_ptr + lse_off, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_reqs"])  # type: ignore[untyped-decorator]
def _merge_splits_kernel(
    out_ptr: tl.tensor,  # [num_tokens, num_heads, head_dim]
    partial_ptr: tl.tensor,  # [NUM_SPLITS, num_tokens, num_heads, head_dim] fp32
    lse_ptr: tl.tensor,  # [NUM_SPLITS, num_tokens, num_heads] fp32
    query_start_loc_ptr: tl.tensor,  # [num_reqs + 1]
    num_reqs: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    stride_split: tl.tensor,
    stride_pt: tl.tensor,
    stride_ph: tl.tensor,
    stride_lse_split: tl.tensor,
    stride_lse_t: tl.tensor,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
) -> None:
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_reqs):  # padding past the last request
        return
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < NUM_SPLITS
    lse = tl.load(
        lse_ptr + splits * stride_lse_split + token * stride_lse_t + head,
        mask=split_ok,
        other=float("-inf"),
    )  # [SPLITS_PAD]
    lse_max = tl.max(lse, axis=0)
    weight = tl.math.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))
    weight = weight / tl.maximum(tl.sum(weight, axis=0), 1e-30)
    dims = tl.arange(0, HEAD_DIM_PAD)
    part = tl.load(
        partial_ptr
        + splits[:, None] * stride_split
        + token.to(tl.int64) * stride_pt
        + head * stride_ph
        + dims[None, :],
        mask=split_ok[:, None] & (weight[:, None] > 0.0) & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )  # [SPLITS_PAD, HEAD_DIM_PAD]
    out = tl.sum(part * weight[:, None], axis=0)
    dst = out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + dims
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_m: int | None = None,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens against its paged context.

    query: [num_tokens, num_heads, head_dim]; kv_cache: [2, num_blocks, block_size,
    num_kv_heads, head_dim]; query_start_loc: [num_reqs + 1]; seq_lens: [num_reqs] (context
    including the new tokens); block_table: [num_reqs, max_blocks]. Returns [num_tokens,
    num_heads, head_dim]; rows past query_start_loc[-1] (padding) are left unwritten.
    max_query_len / max_seq_len are host-side hints for the tiling (never read from the
    device); num_splits, block_m, tile_n, num_warps and num_stages override the heuristics
    (for tuning; any value gives the same result).
    """
    num_tokens, num_heads, head_dim = _check_inputs(
        query, kv_cache, query_start_loc, seq_lens, block_table
    )
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    num_reqs = seq_lens.shape[0]
    out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
    if num_tokens == 0 or num_reqs == 0:
        return out
    block_q = _block_q(group, max_query_len, block_m)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    tile_n = max(16, tile_n or (64 if head_dim_pad <= 128 else 32))
    grid_q = num_tokens if block_q == 1 else num_tokens // block_q + num_reqs
    if num_splits is None:
        busy = grid_q if max_query_len is None else num_reqs * triton.cdiv(max_query_len, block_q)
        num_splits = _default_splits(query.device, busy * num_kv_heads, max_seq_len, tile_n)
    partial, lse = out, out  # placeholders when there is nothing to merge
    if num_splits > 1:
        partial = torch.empty(
            num_splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=query.device
        )  # [num_splits, num_tokens, num_heads, head_dim]
        lse = torch.empty(
            num_splits, num_tokens, num_heads, dtype=torch.float32, device=query.device
        )  # [num_splits, num_tokens, num_heads]
    target = partial if num_splits > 1 else out
    _paged_attention_kernel[(grid_q, num_kv_heads, num_splits)](
        target, lse, query, kv_cache, query_start_loc, seq_lens, block_table,
        scale * LOG2E, num_reqs,
        query.stride(0), query.stride(1), target.stride(-3), target.stride(-2),
        partial.stride(0) if num_splits > 1 else 0,
        lse.stride(0) if num_splits > 1 else 0,
        lse.stride(1) if num_splits > 1 else 0,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_table.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        PRECISION="ieee" if query.dtype == torch.float32 else None,  # fp32 matches the CPU
        num_warps=num_warps or (4 if block_m <= 16 else 8),
        num_stages=num_stages or 3,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, partial, lse, query_start_loc, num_reqs,
            out.stride(0), out.stride(1),
            partial.stride(0), partial.stride(1), partial.stride(2),
            lse.stride(0), lse.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )  # fmt: skip
    return out


def _check_inputs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> tuple[int, int, int]:
    check(query, "query", 3)
    check(kv_cache, "kv_cache", 5, dtypes=(query.dtype,))
    check(query_start_loc, "query_start_loc", 1, dtypes=INDEX_DTYPES)
    check(seq_lens, "seq_lens", 1, dtypes=INDEX_DTYPES)
    check(block_table, "block_table", 2, dtypes=INDEX_DTYPES)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    check_shape(kv_cache, "kv_cache", (2, *kv_cache.shape[1:4], head_dim))
    num_reqs = seq_lens.shape[0]
    check_shape(query_start_loc, "query_start_loc", (num_reqs + 1,))
    check_shape(block_table, "block_table", (num_reqs, block_table.shape[1]))
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_device(query, kv_cache, query_start_loc, seq_lens, block_table)
    return num_tokens, num_heads, head_dim


def _block_q(group: int, max_query_len: int | None, block_m: int | None) -> int:
    """Query tokens per program: about 64 rows (block_m) of tokens x heads, fewer for short
    queries (one for a decode-only batch). Powers of two keep the compiled variants few."""
    block_q = max(1, (block_m or 64) // group)
    if max_query_len is None:
        return block_q
    return max(1, min(block_q, int(triton.next_power_of_2(max(1, max_query_len)))))


def _default_splits(
    device: torch.device, num_programs: int, max_seq_len: int | None, tile_n: int
) -> int:
    """Split the key range when the batch alone cannot fill the GPU (long-context decode)."""
    if device.type != "cuda" or not max_seq_len:
        return 1
    target = 4 * _num_sms(device.index if device.index is not None else 0)
    if num_programs >= target:
        return 1
    by_occupancy = int(triton.next_power_of_2(math.ceil(target / num_programs)))
    by_length = max(1, max_seq_len // (4 * tile_n))  # at least 4 tiles per split
    return min(by_occupancy, 1 << (by_length.bit_length() - 1), MAX_SPLITS)  # a power of two


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
