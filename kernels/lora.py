"""Batched LoRA (Punica-style) as two Triton kernels over a per-token adapter slot; see
reference.add_lora.

`shrink`: buffer[t, k] = lora_a[s, :, K_k] @ x[t, K_k] ([rank], fp32), split over slices
K_k of SPLIT_K input features so a decode step's few tokens still fill the GPU; `expand`:
y[t] += lora_b[s] @ sum_k buffer[t, k] in fp32 (slices summed in order), rounded once into y.
s = token_lora_indices[t]; tokens of slot -1 are skipped by both kernels (their y is neither
read nor written). Each program serves one token and the splits depend on in_features only,
so a token's bits do not depend on the other tokens of the call. The adapter's scaling is
folded into lora_b by the caller. Slots are not range-checked (that would cost a device sync
per projection): the caller's mapping holds only loaded slots.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kernels._checks import INDEX_DTYPES, check, check_device, check_shape, next_pow2

MAX_BLOCK_RANK = 64  # rank block of a program; larger ranks are split over programs / loops
TILE = 4096  # elements of the fp32 weight tile a program holds (rank block x in/out block)
SPLIT_K = 512  # input features a shrink program sums


@triton.jit  # type: ignore[untyped-decorator]
def _shrink_kernel(
    x_ptr: tl.tensor,  # [num_tokens, in]
    lora_a_ptr: tl.tensor,  # [num_slots, rank, in]
    buffer_ptr: tl.tensor,  # [num_tokens, num_splits, rank] fp32
    indices_ptr: tl.tensor,  # [num_tokens]
    rank: tl.tensor,
    in_features: tl.tensor,
    stride_x: tl.tensor,
    stride_a_slot: tl.tensor,
    stride_a_rank: tl.tensor,
    stride_buffer: tl.tensor,
    stride_buffer_split: tl.tensor,
    SPLIT_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(indices_ptr + token).to(tl.int64)
    if slot < 0:
        return
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    row_mask = rows < rank
    a_rows = lora_a_ptr + slot * stride_a_slot + rows[:, None] * stride_a_rank
    split = tl.program_id(2)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(split * SPLIT_K, split * SPLIT_K + SPLIT_K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        col_mask = cols < in_features
        x = tl.load(x_ptr + token * stride_x + cols, mask=col_mask, other=0.0)
        a = tl.load(a_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(
        buffer_ptr + token * stride_buffer + split * stride_buffer_split + rows, acc, mask=row_mask
    )


@triton.jit  # type: ignore[untyped-decorator]
def _expand_kernel(
    buffer_ptr: tl.tensor,  # [num_tokens, num_splits, rank] fp32
    lora_b_ptr: tl.tensor,  # [num_slots, out, rank]
    y_ptr: tl.tensor,  # [num_tokens, out], updated in place
    indices_ptr: tl.tensor,  # [num_tokens]
    rank: tl.tensor,
    out_features: tl.tensor,
    num_splits: tl.tensor,
    stride_buffer: tl.tensor,
    stride_buffer_split: tl.tensor,
    stride_b_slot: tl.tensor,
    stride_b_out: tl.tensor,
    stride_y: tl.tensor,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(indices_ptr + token).to(tl.int64)
    if slot < 0:
        return
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    out_mask = outs < out_features
    b_rows = lora_b_ptr + slot * stride_b_slot + outs[:, None] * stride_b_out
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)  # [BLOCK_R]
        rank_mask = ranks < rank
        partials = buffer_ptr + token * stride_buffer + ranks
        shrunk = tl.load(partials, mask=rank_mask, other=0.0)
        for k in range(1, num_splits):
            shrunk += tl.load(partials + k * stride_buffer_split, mask=rank_mask, other=0.0)
        b = tl.load(b_rows + ranks[None, :], mask=out_mask[:, None] & rank_mask[None, :], other=0.0)
        acc += tl.sum(b.to(tl.float32) * shrunk[None, :], axis=1)
    y_row = y_ptr + token * stride_y + outs
    y = tl.load(y_row, mask=out_mask, other=0.0)
    tl.store(y_row, (y.to(tl.float32) + acc).to(y.dtype), mask=out_mask)  # one rounding


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_lora_indices: torch.Tensor,
) -> torch.Tensor:
    """y [num_tokens, out] += lora_b[s] @ lora_a[s] @ x[t] in place, s = token_lora_indices[t]
    (int32/int64, -1: y[t] untouched); x [num_tokens, in], lora_a [num_slots, rank, in],
    lora_b [num_slots, out, rank]. Returns y."""
    check(y, "y", 2)
    check(x, "x", 2)
    check(lora_a, "lora_a", 3)
    check(lora_b, "lora_b", 3)
    check(token_lora_indices, "token_lora_indices", 1, dtypes=INDEX_DTYPES)
    num_tokens, out_features = y.shape
    in_features = x.shape[1]
    num_slots, rank = lora_a.shape[:2]
    check_shape(x, "x", (num_tokens, in_features))
    check_shape(lora_a, "lora_a", (num_slots, rank, in_features))
    check_shape(lora_b, "lora_b", (num_slots, out_features, rank))
    check_shape(token_lora_indices, "token_lora_indices", (num_tokens,))
    check_device(y, x, lora_a, lora_b, token_lora_indices)
    if num_tokens == 0 or out_features == 0 or rank == 0 or num_slots == 0:
        return y
    num_splits = max(1, triton.cdiv(in_features, SPLIT_K))
    buffer = torch.empty(num_tokens, num_splits, rank, dtype=torch.float32, device=y.device)
    block_r = min(next_pow2(rank), MAX_BLOCK_RANK)
    block_k = max(16, min(next_pow2(in_features), TILE // block_r, SPLIT_K))
    _shrink_kernel[(num_tokens, triton.cdiv(rank, block_r), num_splits)](
        x, lora_a, buffer, token_lora_indices, rank, in_features,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), buffer.stride(0), buffer.stride(1),
        SPLIT_K=SPLIT_K, BLOCK_R=block_r, BLOCK_K=block_k,
    )  # fmt: skip
    block_n = max(16, min(next_pow2(out_features), TILE // block_r))
    _expand_kernel[(num_tokens, triton.cdiv(out_features, block_n))](
        buffer, lora_b, y, token_lora_indices, rank, out_features, num_splits,
        buffer.stride(0), buffer.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_R=block_r, BLOCK_N=block_n,
    )  # fmt: skip
    return y
