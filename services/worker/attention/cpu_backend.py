"""Paged attention for the CPU.

Where the C++ CPU ops run (kernels/cpu_ops.py; fp32, head_dim a multiple of 16), every token
of a step, decode and prefill alike, goes through `skiff_cpu::paged_attention`: it reads each
request's context in place through the block table, each key and value read once for the
query heads that share it: per token for decode tokens, per tile of tokens for prefill chunks
(flash-attention style: an online softmax over tiles of keys, causal tiles skipped).

Otherwise plain torch: decode requests (one query token) are batched into a few SDPA calls,
grouped by context length so that padding to the group's longest context stays small; prefill
chunks run one request at a time. Keys and values are gathered from the paged cache with one
`index_select` per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from kernels import ops
from services.worker.attention.base import AttentionMetadata

# A new decode group starts when a context is shorter than this fraction of the group's longest.
GROUP_LENGTH_RATIO = 0.75


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [group] query rows of single-token requests
    blocks: torch.Tensor  # [group, max_blocks] block ids, padded
    mask: torch.Tensor  # [group, 1, 1, max_blocks * block_size] bool: position < seq_len


@dataclass
class _Prefill:
    start: int
    end: int
    seq_len: int
    blocks: torch.Tensor  # [num_blocks] int64


@dataclass
class _StepPlan:
    decodes: list[_DecodeGroup]
    prefills: list[_Prefill]


def _plan(meta: AttentionMetadata, block_size: int) -> _StepPlan:
    """Derived once per step from the metadata, shared by every layer."""
    q_lens, seq_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    starts = meta.query_start_loc.tolist()
    prefills = [
        _Prefill(
            starts[i],
            starts[i + 1],
            seq_lens[i],
            meta.block_table[i, : -(-seq_lens[i] // block_size)].long(),
        )
        for i, n in enumerate(q_lens)
        if n > 1
    ]
    decodes = sorted((i for i, n in enumerate(q_lens) if n == 1), key=lambda i: -seq_lens[i])
    groups: list[list[int]] = []
    for i in decodes:
        if not groups or seq_lens[i] < GROUP_LENGTH_RATIO * seq_lens[groups[-1][0]]:
            groups.append([])
        groups[-1].append(i)
    return _StepPlan([_decode_group(meta, g, starts, block_size) for g in groups], prefills)


def _decode_group(
    meta: AttentionMetadata, reqs: list[int], starts: list[int], block_size: int
) -> _DecodeGroup:
    max_blocks = -(-meta.seq_lens_cpu[reqs[0]] // block_size)  # reqs[0] has the longest context
    idx = torch.tensor(reqs, dtype=torch.long)
    mask = torch.arange(max_blocks * block_size) < meta.seq_lens[idx].unsqueeze(1)
    return _DecodeGroup(
        rows=torch.tensor([starts[i] for i in reqs], dtype=torch.long),
        blocks=meta.block_table[idx, :max_blocks].long(),
        mask=mask[:, None, None, :],
    )


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache: [num_blocks, block_size, kv_heads, head_dim], blocks: [num_reqs, max_blocks]
    -> [num_reqs, max_blocks * block_size, kv_heads, head_dim] (index_select: one copy)."""
    gathered = cache.index_select(0, blocks.flatten())
    return gathered.view(blocks.shape[0], -1, *cache.shape[-2:])


class CpuAttentionBackend:
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        ops.write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        if ops.use_cpu_ops(query) and query.shape[-1] % 16 == 0:
            slots = kv_cache.flatten(1, 2)  # [2, num_slots, kv_heads, head_dim]
            attended: torch.Tensor = torch.ops.skiff_cpu.paged_attention(
                query.contiguous(), slots[0], slots[1], meta.query_start_loc, meta.seq_lens,
                meta.block_table, scale, kv_cache.shape[2],
            )  # fmt: skip
            return attended
        if not isinstance(meta.backend_state, _StepPlan):  # the step's first layer
            meta.backend_state = _plan(meta, kv_cache.shape[2])
        plan = meta.backend_state
        out = torch.empty_like(query)
        for group in plan.decodes:
            out[group.rows] = self._decode(query, kv_cache, group, scale)
        for p in plan.prefills:
            out[p.start : p.end] = self._prefill(
                query[p.start : p.end],
                key[p.start : p.end],
                value[p.start : p.end],
                kv_cache,
                p.seq_len,
                p.blocks,
                scale,
            )
        return out

    @staticmethod
    def _decode(
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        group: _DecodeGroup,
        scale: float,
    ) -> torch.Tensor:
        q = query[group.rows].unsqueeze(2)  # [group, num_heads, 1, head_dim]
        k, v = (_gather(kv_cache[i], group.blocks) for i in (0, 1))  # [group, len, kv, dim]
        out = F.scaled_dot_product_attention(
            q,
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=group.mask,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)  # [group, num_heads, head_dim]

    @staticmethod
    def _prefill(
        query: torch.Tensor,  # [q_len, num_heads, head_dim]
        key: torch.Tensor,  # [q_len, num_kv_heads, head_dim]
        value: torch.Tensor,  # [q_len, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        seq_len: int,
        blocks: torch.Tensor,  # [num_blocks] int64
        scale: float,
    ) -> torch.Tensor:
        q_len = query.shape[0]
        if q_len == seq_len:  # no earlier context: attend to the new keys directly
            k, v, causal, mask = key, value, True, None
        else:  # chunk after cached context: read the whole context from the cache
            k = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:seq_len]
            v = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:seq_len]
            q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
            causal, mask = False, torch.arange(seq_len).unsqueeze(0) <= q_pos
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1)  # [q_len, num_heads, head_dim]
