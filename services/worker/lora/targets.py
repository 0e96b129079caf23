"""The projections an adapter may target: PEFT's module names (a Llama-family checkpoint's)
and where each lies in our model, whose q/k/v and gate/up projections are fused."""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.model_config import ModelConfig

# PEFT target -> (our fused module, relative to a decoder layer; its slice on dim 0)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}


@dataclass(frozen=True)
class ModuleShape:
    """One of our LoRA-carrying modules: its input size and the output size of each slice."""

    in_features: int
    slice_sizes: tuple[int, ...]


def module_shapes(mc: ModelConfig) -> dict[str, ModuleShape]:
    """Each LoRA-carrying module of a decoder layer (our name) and its shape."""
    q_size, kv_size = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    hidden, inter = mc.hidden_size, mc.intermediate_size
    return {
        "self_attn.qkv_proj": ModuleShape(hidden, (q_size, kv_size, kv_size)),
        "self_attn.o_proj": ModuleShape(q_size, (hidden,)),
        "mlp.gate_up_proj": ModuleShape(hidden, (inter, inter)),
        "mlp.down_proj": ModuleShape(inter, (hidden,)),
    }


def target_shape(mc: ModelConfig, target: str) -> tuple[int, int]:
    """(in_features, out_features) of a PEFT target's projection."""
    module, index = TARGETS[target]
    shape = module_shapes(mc)[module]
    return shape.in_features, shape.slice_sizes[index]
