"""Building blocks shared by the decoder-only models."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels import ops
from services.worker.attention import AttentionBackend, AttentionMetadata
from services.worker.model_config import ModelConfig
from services.worker.models.rope import rope_inv_freq

if TYPE_CHECKING:
    from services.worker.lora.weights import ModuleLoRA


def weight_scale(module: nn.Module) -> torch.Tensor | None:
    """The group scales an int8 weight carries (services/worker/weight_format.py), else None."""
    return getattr(module, "weight_scale", None)


def weight_panels(module: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The weight packed in panels for the CPU's panel kernel and, for int8, its scales'
    panels (services/worker/weight_format.py pack_panels); None where it is not packed."""
    return getattr(module, "weight_panels", None), getattr(module, "weight_panel_scale", None)


def project(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` through `ops.linear`, int8 weights with their scales, packed weights in
    their panels; plus the update of the step's LoRA adapters where the module carries
    adapter slots (`module.lora`, services/worker/lora/weights.py) and a token of the step
    runs with one."""
    panels, panel_scale = weight_panels(module)
    y = ops.linear(x, module.weight, module.bias, weight_scale(module), panels, panel_scale)
    lora: ModuleLoRA | None = getattr(module, "lora", None)
    if lora is not None and lora.step.mapping is not None:
        ops.add_lora(y, x, lora.lora_a, lora.lora_b, lora.step.mapping, lora.slice_sizes)
    return y


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [num_tokens, size] -> (normed, x + residual)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


def rotary_cos_sin_cache(config: ModelConfig, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos of every angle in the first half, sin in the second."""
    inv_freq = rope_inv_freq(config)  # [head_dim / 2]
    angles = torch.outer(torch.arange(max_positions).float(), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


class Attention(nn.Module):
    """Fused QKV projection, optional per-head q/k norm, RoPE, paged attention, output proj."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.backend = backend

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,  # [max_positions, head_dim]
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = project(self.qkv_proj, hidden)
        q, k, v = torch.split(qkv, self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.head_dim))[0].view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim))[0].view_as(k)
        q, k = ops.rotary_embedding(positions, q, k, cos_sin_cache)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)  # [T, heads, head_dim]
        return project(self.o_proj, out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.down_proj, ops.silu_and_mul(project(self.gate_up_proj, x)))
