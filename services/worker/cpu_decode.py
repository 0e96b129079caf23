"""The CPU worker's compiled decode path: each decoder layer of a decode-only step is two
`torch.compile`d calls (inductor's C++ codegen) and one KV-cache write, instead of the ~40
eager ops per layer of the model code.

- `pre_attention`: residual add, RMSNorm, QKV projection (+ bias, q/k norm), rotary.
- `post_attention`: paged attention straight from the cache through the block table (the
  keys and values are read where they lie, never gathered into a padded copy), output
  projection, residual add, RMSNorm, gate/up projection, SiLU-and-mul, down projection.

The two functions are shared by every layer (weights are arguments), and batch size and
context width are dynamic, so one compilation serves every decode step; inductor caches it
on disk, so later processes load it in seconds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from services.worker.attention import AttentionMetadata
from services.worker.models.decoder import DecoderForCausalLM

log = logging.getLogger("skiff.worker.cpu_decode")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotary over the first 2 * cos.shape[-1] dims of [T, heads, head_dim]."""
    rot_dim = 2 * cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim].float(), x[..., rot_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    return torch.cat((out, x_pass), dim=-1)


def pre_attention(
    hidden: torch.Tensor,  # [B, hidden]
    residual: torch.Tensor,  # [B, hidden]
    norm_weight: torch.Tensor,
    qkv_weight: torch.Tensor,  # [q + 2 kv, hidden]
    qkv_bias: torch.Tensor | None,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    cos_sin: torch.Tensor,  # [B, rot_dim] rows of the cos/sin cache at the positions
    eps: float,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> q [B, heads, dim], k and v [B, kv_heads, dim], the new residual [B, hidden]."""
    x = hidden + residual
    qkv = F.linear(_rms_norm(x, norm_weight, eps), qkv_weight, qkv_bias)
    head_dim = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
    kv_size = num_kv_heads * head_dim
    q, k, v = qkv.split([num_heads * head_dim, kv_size, kv_size], dim=-1)
    q = q.reshape(-1, num_heads, head_dim)
    k = k.reshape(-1, num_kv_heads, head_dim)
    v = v.reshape(-1, num_kv_heads, head_dim)
    if q_norm_weight is not None and k_norm_weight is not None:
        q = _rms_norm(q, q_norm_weight, eps)
        k = _rms_norm(k, k_norm_weight, eps)
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v, x


def post_attention(
    q: torch.Tensor,  # [B, heads, dim]
    residual: torch.Tensor,  # [B, hidden]
    key_cache: torch.Tensor,  # [num_slots, kv_heads, dim]
    value_cache: torch.Tensor,  # [num_slots, kv_heads, dim]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    o_weight: torch.Tensor,
    norm_weight: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    eps: float,
    scale: float,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (MLP output, residual) of a layer, both [B, hidden]."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    width = block_table.shape[1] * block_size
    t = torch.arange(width, device=q.device)
    slots = block_table[:, t // block_size].long() * block_size + t % block_size  # [B, T]
    qg = q.view(batch, 1, num_kv_heads, group, head_dim).float()
    keys = key_cache[slots].float().unsqueeze(3)  # [B, T, kv_heads, 1, dim]: fused, not copied
    scores = (qg * keys).sum(-1) * scale  # [B, T, kv_heads, group]
    valid = (t.unsqueeze(0) < seq_lens.unsqueeze(1))[:, :, None, None]
    probs = scores.masked_fill(~valid, float("-inf")).softmax(dim=1)
    values = value_cache[slots].float().unsqueeze(3)  # [B, T, kv_heads, 1, dim]
    attn = (probs.unsqueeze(-1) * values).sum(1).to(q.dtype)  # [B, kv_heads, group, dim]
    x = F.linear(attn.reshape(batch, num_heads * head_dim), o_weight) + residual
    gate, up = F.linear(_rms_norm(x, norm_weight, eps), gate_up_weight).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down_weight), x


def final_norm(
    hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    return _rms_norm(hidden + residual, weight, eps)


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    key_cache: torch.Tensor  # [num_slots, kv_heads, dim], a view of the layer's KV cache
    value_cache: torch.Tensor


class CompiledDecode:
    """Runs decode-only steps of `model` (on the CPU) through the compiled layer functions."""

    def __init__(self, model: DecoderForCausalLM, kv_caches: list[torch.Tensor]) -> None:
        self.model = model
        mc = model.config
        self.eps = mc.rms_norm_eps
        self.num_heads, self.num_kv_heads = mc.num_attention_heads, mc.num_key_value_heads
        self.block_size = kv_caches[0].shape[2]
        self.scale = model.layers[0].self_attn.scale
        self.layers = [
            _layer(layer, cache) for layer, cache in zip(model.layers, kv_caches, strict=True)
        ]
        # dynamic=True: batch size and context width are symbolic (size 1 is specialized).
        # Without duck sizing, sizes that happen to be equal at compile time (batch 2, width
        # 2, the cache's K/V dim 2) are not assumed equal forever: no recompiles mid-serving.
        torch.fx.experimental._config.use_duck_shape = False
        # Compiled code is cached per function, for every model of the process: a model with
        # another variant (bias, q/k norm) adds entries. Past the limit dynamo runs eagerly.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self._pre = torch.compile(pre_attention, dynamic=True)
        self._post = torch.compile(post_attention, dynamic=True)
        self._final = torch.compile(final_norm, dynamic=True)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode-only step (one query token per request)."""
        model = self.model
        residual = model.embed_tokens(input_ids)
        hidden = torch.zeros_like(residual)  # layer 0 adds it to the embedding: exact
        cos_sin = model.cos_sin_cache[positions]
        slots, seq_lens = meta.slot_mapping, meta.seq_lens
        block_table = meta.block_table
        if block_table.shape[1] == 1:  # one width-1 graph less: the extra block is masked
            block_table = F.pad(block_table, (0, 1))
        for layer in self.layers:
            q, k, v, residual = self._pre(
                hidden, residual, layer.input_norm, layer.qkv, layer.qkv_bias, layer.q_norm,
                layer.k_norm, cos_sin, self.eps, self.num_heads, self.num_kv_heads,
            )  # fmt: skip
            layer.key_cache.index_copy_(0, slots, k)
            layer.value_cache.index_copy_(0, slots, v)
            hidden, residual = self._post(
                q, residual, layer.key_cache, layer.value_cache, block_table, seq_lens,
                layer.o, layer.post_norm, layer.gate_up, layer.down, self.eps, self.scale,
                self.block_size,
            )  # fmt: skip
        return self._final(hidden, residual, model.norm.weight, self.eps)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile for one request and for several (writes slots 0-1 of block 0, still free)."""
        start = time.perf_counter()
        for batch in (1, 3):
            meta = AttentionMetadata(
                query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
                seq_lens=torch.ones(batch, dtype=torch.int32),
                block_table=torch.zeros(batch, 5, dtype=torch.int32),
                slot_mapping=torch.arange(batch),
                max_query_len=1,
                max_seq_len=1,
            )
            ids = torch.zeros(batch, dtype=torch.long)
            self.forward(ids, torch.zeros(batch, dtype=torch.long), meta)
        log.info("compiled the CPU decode path in %.1f s", time.perf_counter() - start)


def _layer(layer: torch.nn.Module, cache: torch.Tensor) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    flat = cache.flatten(1, 2)  # [2, num_slots, kv_heads, dim]: views of the cache
    return _Layer(
        layer.input_layernorm.weight,
        attn.qkv_proj.weight,
        attn.qkv_proj.bias,
        attn.q_norm.weight if attn.qk_norm else None,
        attn.k_norm.weight if attn.qk_norm else None,
        attn.o_proj.weight,
        layer.post_attention_layernorm.weight,
        mlp.gate_up_proj.weight,
        mlp.down_proj.weight,
        flat[0],
        flat[1],
    )
