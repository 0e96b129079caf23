"""Blocks of the device pool in the tiers' layout. The runner keeps one KV tensor per layer,
[2, num_blocks, block_size, num_kv_heads, head_dim]; a lower tier, and the wire, keep one
block of every layer contiguous: [num_layers, 2, block_size, num_kv_heads, head_dim]."""

from __future__ import annotations

import numpy as np
import torch


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
    """[n, num_layers, 2, block_size, kv_heads, head_dim] copy of `block_ids` ([n] int64 on
    the caches' device), on that device."""
    two, _, block_size, heads, head_dim = kv_caches[0].shape
    out = kv_caches[0].new_empty((len(block_ids), len(kv_caches), two, block_size, heads, head_dim))
    for layer, kv in enumerate(kv_caches):  # one copy, no stacked intermediate
        out[:, layer].copy_(kv.index_select(1, block_ids).transpose(0, 1))
    return out


def scatter_blocks(
    kv_caches: list[torch.Tensor], block_ids: torch.Tensor, blocks: torch.Tensor
) -> None:
    """Write `blocks` ([n, num_layers, 2, block_size, kv_heads, head_dim], on the caches'
    device) into the device blocks `block_ids` ([n] int64 there)."""
    for layer, kv in enumerate(kv_caches):
        kv.index_copy_(1, block_ids, blocks[:, layer].transpose(0, 1))  # [2, n, bs, h, d]


def block_shape(kv_caches: list[torch.Tensor]) -> tuple[int, ...]:
    """(num_layers, 2, block_size, kv_heads, head_dim): one block in the tiers' layout."""
    two, _, block_size, heads, head_dim = kv_caches[0].shape
    return (len(kv_caches), two, block_size, heads, head_dim)


def block_nbytes(kv_caches: list[torch.Tensor]) -> int:
    """Bytes of one block of every layer, K and V."""
    shape = block_shape(kv_caches)
    return int(torch.Size(shape).numel()) * kv_caches[0].element_size()


def copy_payload(dst: torch.Tensor, data: memoryview | bytes) -> None:
    """Copy one block's payload into `dst`, a contiguous CPU tensor of one block."""
    flat = dst.view(-1).view(torch.uint8).numpy()  # [block_bytes], shares dst's memory
    flat[:] = np.frombuffer(data, dtype=np.uint8)


def payload(block: torch.Tensor) -> memoryview:
    """The bytes of `block`, a contiguous CPU tensor (no copy)."""
    return block.view(-1).view(torch.uint8).numpy().data
