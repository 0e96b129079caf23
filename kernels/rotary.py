"""Neox-style rotary embedding as a Triton kernel; see reference.rotary_embedding.

The kernel only reads `cos_sin_cache` ([max_position, rot_dim]: cos half, then sin half), so
any frequency scaling (llama3, linear, …) is whatever the model baked into that cache.
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kernels._checks import INDEX_DTYPES, check, check_device, check_shape


@triton.jit  # type: ignore[untyped-decorator]
def _rotate_heads(
    x_ptr: tl.tensor,  # one token's [num_heads, head_dim]
    out_ptr: tl.tensor,
    stride_h: tl.tensor,
    stride_out_h: tl.tensor,
    cos: tl.tensor,  # [BLOCK_HALF] fp32
    sin: tl.tensor,
    num_heads: tl.tensor,
    HEAD_DIM: tl.constexpr,
    ROT_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    half = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    mask = (heads < num_heads) & (half < ROT_HALF)
    src = x_ptr + heads * stride_h + half
    dst = out_ptr + heads * stride_out_h + half
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + ROT_HALF, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(dst, (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(dst + ROT_HALF, (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype), mask=mask)
    if 2 * ROT_HALF < HEAD_DIM:  # copy the dims past rot_dim unchanged
        dims = tl.arange(0, BLOCK_D)[None, :]
        keep = (heads < num_heads) & (dims >= 2 * ROT_HALF) & (dims < HEAD_DIM)
        rest = tl.load(x_ptr + heads * stride_h + dims, mask=keep, other=0.0)
        tl.store(out_ptr + heads * stride_out_h + dims, rest, mask=keep)


@triton.jit  # type: ignore[untyped-decorator]
def _rotary_kernel(
    positions_ptr: tl.tensor,  # [num_tokens]
    query_ptr: tl.tensor,  # [num_tokens, num_heads, head_dim]
    key_ptr: tl.tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_ptr: tl.tensor,  # [max_position, 2 * ROT_HALF]
    query_out_ptr: tl.tensor,
    key_out_ptr: tl.tensor,
    num_heads: tl.tensor,
    num_kv_heads: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_kt: tl.tensor,
    stride_kh: tl.tensor,
    stride_qot: tl.tensor,
    stride_qoh: tl.tensor,
    stride_kot: tl.tensor,
    stride_koh: tl.tensor,
    stride_cache: tl.tensor,
    HEAD_DIM: tl.constexpr,
    ROT_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    half = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + pos * stride_cache
    cos = tl.load(row + half, mask=half < ROT_HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + ROT_HALF + half, mask=half < ROT_HALF, other=0.0).to(tl.float32)
    _rotate_heads(
        query_ptr + token * stride_qt, query_out_ptr + token * stride_qot, stride_qh, stride_qoh,
        cos, sin, num_heads, HEAD_DIM, ROT_HALF, BLOCK_H, BLOCK_HALF, BLOCK_D,
    )  # fmt: skip
    _rotate_heads(
        key_ptr + token * stride_kt, key_out_ptr + token * stride_kot, stride_kh, stride_koh,
        cos, sin, num_kv_heads, HEAD_DIM, ROT_HALF, BLOCK_H, BLOCK_HALF, BLOCK_D,
    )  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [num_tokens]; query: [num_tokens, num_heads, head_dim];
    key: [num_tokens, num_kv_heads, head_dim]; cos_sin_cache: [max_position, rot_dim].
    Returns new (query, key) with the first rot_dim dims of each head rotated.
    """
    check(positions, "positions", 1, dtypes=INDEX_DTYPES, last_contiguous=False)
    check(query, "query", 3)
    check(key, "key", 3, dtypes=(query.dtype,))
    check(cos_sin_cache, "cos_sin_cache", 2)
    num_tokens, num_heads, head_dim = query.shape
    check_shape(positions, "positions", (num_tokens,))
    check_shape(key, "key", (num_tokens, key.shape[1], head_dim))
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"rot_dim {rot_dim} must be even and <= head_dim {head_dim}")
    check_device(positions, query, key, cos_sin_cache)
    query_out, key_out = torch.empty_like(query), torch.empty_like(key)
    if num_tokens == 0:
        return query_out, key_out
    _rotary_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache, query_out, key_out, num_heads, key.shape[1],
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        query_out.stride(0), query_out.stride(1), key_out.stride(0), key_out.stride(1),
        cos_sin_cache.stride(0),
        HEAD_DIM=head_dim,
        ROT_HALF=rot_dim // 2,
        BLOCK_H=triton.next_power_of_2(max(num_heads, key.shape[1])),
        BLOCK_HALF=triton.next_power_of_2(max(1, rot_dim // 2)),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return query_out, key_out
