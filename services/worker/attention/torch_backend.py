"""Plain-torch paged attention for the CPU: decode requests batched in one SDPA call,
prefill chunks one request at a time."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from kernels import ops
from services.worker.attention.base import AttentionMetadata


@dataclass
class _StepPlan:
    decode_rows: torch.Tensor  # [num_decodes] query rows of single-token requests
    decode_blocks: torch.Tensor  # [num_decodes, max_decode_blocks]
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_decode_blocks * block_size] bool
    prefills: list[tuple[int, int, int, torch.Tensor]]  # (start, end, seq_len, block ids)


def _plan(meta: AttentionMetadata, block_size: int) -> _StepPlan:
    q_lens, seq_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    starts = meta.query_start_loc.tolist()
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    max_dec_len = max((seq_lens[i] for i in decodes), default=0)
    max_dec_blocks = -(-max_dec_len // block_size)
    decode_idx = torch.tensor(decodes, dtype=torch.long)
    dec_seq_lens = meta.seq_lens[decode_idx]
    mask = torch.arange(max_dec_blocks * block_size) < dec_seq_lens.unsqueeze(1)
    prefills = [
        (
            starts[i],
            starts[i + 1],
            seq_lens[i],
            meta.block_table[i, : -(-seq_lens[i] // block_size)].long(),
        )
        for i, n in enumerate(q_lens)
        if n > 1
    ]
    return _StepPlan(
        decode_rows=torch.tensor([starts[i] for i in decodes], dtype=torch.long),
        decode_blocks=meta.block_table[decode_idx, :max_dec_blocks].long(),
        decode_mask=mask[:, None, None, :],
        prefills=prefills,
    )


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache: [num_blocks, block_size, kv_heads, head_dim], blocks: [num_reqs, max_blocks]
    -> [num_reqs, max_blocks * block_size, kv_heads, head_dim] (index_select: one copy)."""
    gathered = cache.index_select(0, blocks.flatten())
    return gathered.view(blocks.shape[0], -1, *cache.shape[-2:])


class TorchAttentionBackend:
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
        if meta.backend_state is None:
            meta.backend_state = _plan(meta, kv_cache.shape[2])
        plan: _StepPlan = meta.backend_state
        out = torch.empty_like(query)
        if plan.decode_rows.numel():
            out[plan.decode_rows] = self._decode(query, kv_cache, plan, scale)
        for start, end, seq_len, blocks in plan.prefills:
            out[start:end] = self._prefill(
                query[start:end], key[start:end], value[start:end], kv_cache, seq_len, blocks, scale
            )
        return out

    @staticmethod
    def _decode(query, kv_cache, plan: _StepPlan, scale: float) -> torch.Tensor:
        q = query[plan.decode_rows].unsqueeze(2)  # [num_decodes, num_heads, 1, head_dim]
        k, v = (_gather(kv_cache[i], plan.decode_blocks) for i in (0, 1))
        out = F.scaled_dot_product_attention(
            q,
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=plan.decode_mask,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)  # [num_decodes, num_heads, head_dim]

    @staticmethod
    def _prefill(query, key, value, kv_cache, seq_len, blocks, scale) -> torch.Tensor:
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
