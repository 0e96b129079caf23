"""Attention on CUDA through the Triton kernels, over the shared paged KV cache layout."""

from __future__ import annotations

import torch

from kernels.kv_cache import write_kv_cache
from kernels.paged_attention import paged_attention
from services.worker.attention.base import AttentionMetadata


class TritonAttentionBackend:
    """Writes the step's keys/values through slot_mapping, then runs one paged-attention launch
    for the whole mixed batch (prefill chunks and decode tokens together)."""

    name = "triton"

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        return paged_attention(
            query,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            scale,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
        )
