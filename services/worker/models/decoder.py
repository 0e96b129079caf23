"""One model class for the Llama family (Llama 2/3, Mistral, SmolLM) and Qwen2 / Qwen3.

The differences are configuration: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), llama3
RoPE scaling, tied embeddings. The model computes hidden states and logits, nothing else.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import ops
from services.worker.attention import AttentionBackend, AttentionMetadata
from services.worker.model_config import ModelConfig
from services.worker.models.layers import (
    MLP,
    Attention,
    RMSNorm,
    project,
    rotary_cos_sin_cache,
)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Attention(config, backend)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderForCausalLM(nn.Module):
    """`progress` counts the decoder layers run and the logits computed since it was made: a
    plain int, read by another thread to tell a long step from a hung one (on a GPU it counts
    layers launched, which run ahead of the device by at most the launch queue)."""

    cos_sin_cache: torch.Tensor  # [max_positions, rot_dim], a buffer

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.progress = 0
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Linear | None = None  # tied: the embedding is the LM head
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer(
            "cos_sin_cache", rotary_cos_sin_cache(config, max_positions), persistent=False
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(
                positions, hidden, residual, kv_cache, meta, self.cos_sin_cache
            )
            self.progress += 1
        normed: torch.Tensor = self.norm(hidden, residual)[0]
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_reqs, hidden_size] -> logits [num_reqs, vocab_size]."""
        self.progress += 1
        if self.lm_head is None:
            return ops.linear(hidden, self.embed_tokens.weight)
        return project(self.lm_head, hidden)
