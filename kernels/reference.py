"""Plain-torch reference implementations: the CPU path runs these; tests compare kernels to them."""

from __future__ import annotations

import torch

from shared.arith import cdiv


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm.

    x, residual: [num_tokens, hidden]; weight: [hidden].
    Returns (normed, new_residual) where new_residual = x + residual (or x when no residual).
    """
    if residual is not None:
        x = x + residual
    variance = x.float().pow(2).mean(-1, keepdim=True)
    normed = (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight
    return normed, x


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding over the first `rot_dim` dims of each head.

    positions: [num_tokens] int64; query: [num_tokens, num_heads, head_dim];
    key: [num_tokens, num_kv_heads, head_dim]; cos_sin_cache: [max_position, rot_dim] fp32
    holding cos in the first half and sin in the second.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [num_tokens, rot_dim / 2] each
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rot_dim = 2 * cos.shape[-1]
        x_rot, x_pass = x[..., :rot_dim].float(), x[..., rot_dim:]
        x1, x2 = x_rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((out, x_pass), dim=-1) if x_pass.numel() else out

    return rotate(query), rotate(key)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * intermediate] (gate | up) -> [num_tokens, intermediate]."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new keys/values into the paged cache; slot -1 marks padding and is skipped.

    key, value: [num_tokens, num_kv_heads, head_dim];
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset.
    """
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of variable-length queries against the paged KV cache, one request at
    a time (the simple reference; the CPU backend batches decode on top of this layout).

    query: [num_tokens, num_heads, head_dim]; query_start_loc: [num_reqs + 1] int32;
    seq_lens: [num_reqs] int32 (context incl. the new tokens); block_table: [num_reqs, max_blocks].
    The new tokens of request i are the last q_len positions of its seq_len context.
    """
    num_heads, block_size = query.shape[1], kv_cache.shape[2]
    out = torch.empty_like(query)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        num_blocks = cdiv(seq_len, block_size)
        blocks = block_table[i, :num_blocks].long()
        k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]  # [seq_len, kv_heads, head_dim]
        v = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
        q = query[start:end]  # [q_len, num_heads, head_dim]
        group = num_heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q_len = end - start
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        mask = torch.arange(seq_len, device=query.device).unsqueeze(0) > q_pos  # [q_len, seq_len]
        scores.masked_fill_(mask, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(query.dtype)
    return out


def add_lora(
    y: torch.Tensor,  # [num_tokens, out], updated in place
    x: torch.Tensor,  # [num_tokens, in]
    lora_a: torch.Tensor,  # [num_slots, rank, in]
    lora_b: torch.Tensor,  # [num_slots, out, rank], the adapter's scaling folded in
    token_lora_indices: torch.Tensor,  # [num_tokens] slot of each token's adapter, -1: none
) -> torch.Tensor:
    """y[t] += lora_b[s] @ (lora_a[s] @ x[t]) for each token t of slot s >= 0, one token at a
    time in fp32 (the low-rank update of a LoRA adapter); tokens of slot -1 keep y[t]."""
    for t, slot in enumerate(token_lora_indices.tolist()):
        if slot >= 0:
            shrunk = lora_a[slot].float() @ x[t].float()  # [rank]
            y[t] += (lora_b[slot].float() @ shrunk).to(y.dtype)
    return y
