"""The attention backend interface and the metadata the model runner prepares for it.

KV cache layout, per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 keys, 1 values); token slot = block_id * block_size + offset in block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Per-step batch layout shared by every layer.

    Requests are laid out in batch order; request i owns query rows
    `query_start_loc[i]:query_start_loc[i + 1]`, which are the last positions of its
    `seq_lens[i]`-token context.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int] = field(default_factory=list)  # host copies for per-request loops
    seq_lens_cpu: list[int] = field(default_factory=list)
    backend_state: object = None  # whatever a backend derives once per step, for all layers


class AttentionBackend(Protocol):
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write the new keys/values through slot_mapping, then attend causally."""
        ...
