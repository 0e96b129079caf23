"""Writing new keys/values into the paged KV cache as a Triton kernel; see
reference.write_kv_cache. Cache layout per layer: [2, num_blocks, block_size, num_kv_heads,
head_dim]; slot = block_id * block_size + offset; slot -1 marks a padding token (skipped).
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from kernels._checks import INDEX_DTYPES, check, check_device, check_shape


@triton.jit  # type: ignore[untyped-decorator]
def _write_kv_kernel(
    key_ptr: tl.tensor,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr: tl.tensor,  # [num_tokens, num_kv_heads, head_dim]
    cache_ptr: tl.tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr: tl.tensor,  # [num_tokens]
    num_kv_heads: tl.tensor,
    head_dim: tl.tensor,
    stride_kt: tl.tensor,
    stride_kh: tl.tensor,
    stride_vt: tl.tensor,
    stride_vh: tl.tensor,
    stride_kv: tl.tensor,
    stride_block: tl.tensor,
    stride_offset: tl.tensor,
    stride_head: tl.tensor,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    dst = (
        cache_ptr
        + (slot // BLOCK_SIZE) * stride_block
        + (slot % BLOCK_SIZE) * stride_offset
        + heads * stride_head
        + dims
    )
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_kv, v, mask=mask)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key, value: [num_tokens, num_kv_heads, head_dim] -> kv_cache[:, slot] in place."""
    check(kv_cache, "kv_cache", 5)
    check(key, "key", 3, dtypes=(kv_cache.dtype,))
    check(value, "value", 3, dtypes=(kv_cache.dtype,))
    check(slot_mapping, "slot_mapping", 1, dtypes=INDEX_DTYPES, last_contiguous=False)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_tokens = key.shape[0]
    check_shape(kv_cache, "kv_cache", (2, kv_cache.shape[1], block_size, num_kv_heads, head_dim))
    check_shape(key, "key", (num_tokens, num_kv_heads, head_dim))
    check_shape(value, "value", (num_tokens, num_kv_heads, head_dim))
    check_shape(slot_mapping, "slot_mapping", (num_tokens,))
    check_device(key, value, kv_cache, slot_mapping)
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping, num_kv_heads, head_dim,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
