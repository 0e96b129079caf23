"""Paged attention on the CPU through the C++ op `skiff_cpu::paged_attention`
(kernels/csrc/cpu_ops.cpp): every token of a step (decode and prefill chunks alike) attends
to its request's context read in place through the block table, one task per (token, KV
head), each key and value read once for the query heads that share it. Where the op does not
apply (not fp32, head_dim not a multiple of 16) the plain-torch backend runs instead."""

from __future__ import annotations

import torch

from kernels import cpu_ops, ops
from services.worker.attention.base import AttentionMetadata
from services.worker.attention.torch_backend import TorchAttentionBackend


class CpuOpsAttentionBackend:
    def __init__(self) -> None:
        self.fallback = TorchAttentionBackend()

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if not (cpu_ops.active() and query.dtype == torch.float32 and query.shape[-1] % 16 == 0):
            return self.fallback.forward(query, key, value, kv_cache, meta, scale)
        ops.write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        slots = kv_cache.flatten(1, 2)  # [2, num_slots, kv_heads, head_dim]
        return torch.ops.skiff_cpu.paged_attention(
            query.contiguous(), slots[0], slots[1], meta.query_start_loc, meta.seq_lens,
            meta.block_table, scale, kv_cache.shape[2],
        )  # fmt: skip
