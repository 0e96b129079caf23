"""The CPU worker's decode path: in a decode-only step (one query token per request) each
decoder layer is one call of the C++ op `skiff_cpu::decode_layer` (kernels/csrc/cpu_ops.cpp)
instead of ~40 eager torch ops: residual add and RMSNorm, QKV projection (+ bias, q/k norm),
rotary, the KV-cache write, paged attention read where the keys and values lie (through the
block table, never gathered into a padded copy), output projection, RMSNorm, gate/up
projection, SiLU-and-mul and down projection. Its projections stream the fp32 weights at close
to the memory bandwidth, which is what bounds a decode step on the CPU. A step with LoRA
adapters passes each projection's adapter slots (services/worker/lora/weights.py) and each
token's slot: the op adds the adapters' updates after each projection (`skiff_cpu::add_lora`).
"""

from __future__ import annotations

from typing import cast

import torch

from kernels import cpu_ops
from kernels.lora_mapping import LoRAMapping
from services.worker.attention import AttentionMetadata
from services.worker.lora.weights import MODULE_ATTR
from services.worker.models.decoder import DecoderForCausalLM, DecoderLayer
from services.worker.models.layers import weight_panels, weight_scale


class FusedCpuDecode:
    """Runs decode-only steps of `model` (fp32, on the CPU) through `skiff_cpu::decode_layer`."""

    def __init__(self, model: DecoderForCausalLM, kv_caches: list[torch.Tensor]) -> None:
        self.model = model
        mc = model.config
        self.eps = mc.rms_norm_eps
        self.num_heads = mc.num_attention_heads
        self.block_size = kv_caches[0].shape[2]
        layers = cast(list[DecoderLayer], list(model.layers))
        self.scale = layers[0].self_attn.scale
        pairs = zip(layers, kv_caches, strict=True)
        self.layers = [_layer_args(layer, cache) for layer, cache in pairs]
        self.lora = [_layer_lora(layer) for layer in layers]  # per layer: [] without adapters

    @property
    def runs_lora(self) -> bool:
        """Steps with adapters run here too: every projection has adapter slots with panels
        (`ops.cpu_lora_panels`)."""
        return all(self.lora) and all(b.dim() == 4 for layer in self.lora for b in layer[1::2])

    @staticmethod
    def supports(model: DecoderForCausalLM) -> bool:
        """The C++ ops run here and cover the model (fp32 activations, weights in any
        services/worker/weight_format.py format; head_dim and projection inputs of 16k
        floats)."""
        mc = model.config
        q_size = mc.num_attention_heads * mc.head_dim
        dims = (mc.hidden_size, mc.intermediate_size, q_size, mc.head_dim)
        return (
            cpu_ops.load()
            and model.norm.weight.dtype == torch.float32
            and all(d % 16 == 0 for d in dims)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRAMapping | None = None,
    ) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode-only step (one query token per request);
        `lora`: its tokens' adapter slots (`runs_lora` must hold)."""
        model = self.model
        residual = model.embed_tokens(input_ids)  # [B, hidden]
        hidden = torch.zeros_like(residual)  # layer 0 adds it to the embedding: exact
        cos_sin = model.cos_sin_cache[positions]  # [B, rot_dim]
        slot_mapping = meta.slot_mapping.long()
        step = (slot_mapping, meta.block_table, meta.seq_lens)
        attention = (self.eps, self.scale, self.num_heads, self.block_size)
        slots = None if lora is None else lora.token_slots
        for (pre, cache, post), adapters in zip(self.layers, self.lora, strict=True):
            hidden, residual = torch.ops.skiff_cpu.decode_layer(
                hidden,
                residual,
                *pre,
                cos_sin,
                *cache,
                *step,
                *post,
                *attention,
                adapters if lora is not None else [],
                slots,
            )
        model.progress += len(self.layers)  # once: nn.Module's __setattr__ costs ~1 µs a call
        normed: torch.Tensor = model.norm(hidden, residual)[0]
        return normed


_Args = tuple[torch.Tensor | None, ...]


def _layer_args(layer: DecoderLayer, kv_cache: torch.Tensor) -> tuple[_Args, _Args, _Args]:
    """A layer's arguments of `decode_layer`, looked up once (module attribute lookups cost
    microseconds, per layer and step): those before cos_sin, the key and value caches as
    [num_slots, kv_heads, head_dim] views, and the weights after the step's tensors: a
    projection's panels where it has them (the kernel, hence the bits, `ops.linear` uses)."""
    attn, mlp = layer.self_attn, layer.mlp

    def weight(module: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and int8 scales the kernel reads: the panels', where packed."""
        panels, panel_scale = weight_panels(module)
        if panels is None:
            return module.weight, weight_scale(module)
        return panels, panel_scale

    pre = (
        layer.input_layernorm.weight,
        weight(attn.qkv_proj)[0],
        attn.qkv_proj.bias,
        attn.q_norm.weight if attn.qk_norm else None,
        attn.k_norm.weight if attn.qk_norm else None,
    )
    slots = kv_cache.flatten(1, 2)  # [2, num_slots, kv_heads, head_dim]
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    post = (
        weight(attn.o_proj)[0],
        layer.post_attention_layernorm.weight,
        weight(mlp.gate_up_proj)[0],
        weight(mlp.down_proj)[0],
        *(weight(p)[1] for p in projections),
    )
    return pre, (slots[0], slots[1]), post


def _layer_lora(layer: DecoderLayer) -> list[torch.Tensor]:
    """The adapter slots of a layer's projections, as `decode_layer` takes them: (lora_a,
    lora_b) of qkv, o, gate_up and down ([] when the model runs without adapters)."""
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    tensors: list[torch.Tensor] = []
    for projection in projections:
        slots = getattr(projection, MODULE_ATTR, None)
        if slots is None:
            return []
        tensors += [slots.lora_a, slots.lora_b]
    return tensors
