"""The CPU worker's decode path: a decode-only step (one query token per request) runs all
decoder layers in one call of the C++ op `skiff_cpu::decode_layers`
(kernels/csrc/cpu_ops.cpp), each layer instead of ~40 eager torch ops: residual add and
RMSNorm, QKV projection (+ bias, q/k norm), rotary, the KV-cache write, paged attention read
where the keys and values lie (through the block table, never gathered into a padded copy),
output projection, RMSNorm, gate/up projection, SiLU-and-mul and down projection. Its
projections stream the weights at close to the memory bandwidth, which is what bounds a
decode step on the CPU. A step with LoRA adapters passes each projection's adapter slots
(services/worker/lora/weights.py) and each token's slot: the op adds the adapters' updates
after each projection (`skiff_cpu::add_lora`).
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
    """Runs decode-only steps of `model` (fp32, on the CPU) through `skiff_cpu::decode_layers`."""

    def __init__(self, model: DecoderForCausalLM, kv_caches: list[torch.Tensor]) -> None:
        self.model = model
        mc = model.config
        self.eps = mc.rms_norm_eps
        self.num_heads = mc.num_attention_heads
        self.block_size = kv_caches[0].shape[2]
        layers = cast(list[DecoderLayer], list(model.layers))
        self.scale = layers[0].self_attn.scale
        self.weights = [w for layer in layers for w in _layer_weights(layer)]
        caches = [kv_cache.flatten(1, 2) for kv_cache in kv_caches]  # [2, slots, kv_heads, hd]
        self.key_caches = [c[0] for c in caches]
        self.value_caches = [c[1] for c in caches]
        per_layer = [_layer_lora(layer) for layer in layers]  # [] without adapters
        self.lora = [t for ts in per_layer for t in ts] if all(per_layer) else []

    @property
    def runs_lora(self) -> bool:
        """Steps with adapters run here too: every projection has adapter slots with panels
        (`ops.cpu_lora_panels`)."""
        return bool(self.lora) and all(b.dim() == 4 for b in self.lora[1::2])

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
        hidden, residual = torch.ops.skiff_cpu.decode_layers(
            hidden,
            residual,
            self.weights,
            cos_sin,
            self.key_caches,
            self.value_caches,
            meta.slot_mapping.long(),
            meta.block_table,
            meta.seq_lens,
            self.eps,
            self.scale,
            self.num_heads,
            self.block_size,
            self.lora if lora is not None else [],
            None if lora is None else lora.token_slots,
        )
        model.progress += len(self.key_caches)  # once: nn.Module's __setattr__ costs ~1 µs a call
        normed: torch.Tensor = model.norm(hidden, residual)[0]
        return normed


def _layer_weights(layer: DecoderLayer) -> list[torch.Tensor | None]:
    """A layer's entries of `decode_layers`' weights, in its order (kernels/csrc/cpu_ops.cpp
    `LayerWeight`), looked up once (module attribute lookups cost microseconds, per layer and
    step): the norms and each projection's panels where it has them (the kernel, hence the
    bits, `ops.linear` uses), then the int8 scales."""
    attn, mlp = layer.self_attn, layer.mlp

    def weight(module: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and int8 scales the kernel reads: the panels', where packed."""
        panels, panel_scale = weight_panels(module)
        if panels is None:
            return module.weight, weight_scale(module)
        return panels, panel_scale

    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    qkv, o, gate_up, down = (weight(p) for p in projections)
    return [
        layer.input_layernorm.weight,
        qkv[0],
        attn.qkv_proj.bias,
        attn.q_norm.weight if attn.qk_norm else None,
        attn.k_norm.weight if attn.qk_norm else None,
        o[0],
        layer.post_attention_layernorm.weight,
        gate_up[0],
        down[0],
        qkv[1],
        o[1],
        gate_up[1],
        down[1],
    ]


def _layer_lora(layer: DecoderLayer) -> list[torch.Tensor]:
    """The adapter slots of a layer's projections, as `decode_layers` takes them: (lora_a,
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
