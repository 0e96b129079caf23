"""Load HF-format safetensors checkpoints (memory-mapped) into our model classes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from kernels import cpu_ops
from services.worker.attention import AttentionBackend
from services.worker.model_config import ModelConfig
from services.worker.models.decoder import DecoderForCausalLM
from services.worker.models.layers import rotary_cos_sin_cache

# HF name -> (our name, shard index in a fused weight); fused weights are concatenated on dim 0.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    with ExitStack() as stack:
        for path in files:
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
            names = handle.keys()  # a safe_open handle is not iterable
            for name in names:
                yield name, handle.get_tensor(name)


def map_name(hf_name: str) -> tuple[str, int | None] | None:
    """Our parameter name for a checkpoint tensor, and its shard index if fused."""
    if hf_name.startswith("model."):
        match = _LAYER.match(hf_name)
        if match:
            layer, module, kind = match.groups()
            if module in _FUSED:
                fused, shard = _FUSED[module]
                return f"layers.{layer}.{fused}.{kind}", shard
            return f"layers.{layer}.{module}.{kind}", None
        return hf_name.removeprefix("model."), None
    if hf_name == "lm_head.weight":
        return hf_name, None
    return None  # e.g. rotary inv_freq buffers of old checkpoints


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
) -> DecoderForCausalLM:
    """The checkpoint of `model_dir`, whose config.json `config` holds, on `device`."""
    model_dir = Path(model_dir)
    with torch.device("meta"):
        model = DecoderForCausalLM(config, backend, max_positions)
    state: dict[str, torch.Tensor] = {}
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for hf_name, tensor in iter_checkpoint(model_dir):
        mapped = map_name(hf_name)
        if mapped is None or (mapped[0] == "lm_head.weight" and config.tie_word_embeddings):
            continue
        name, shard = mapped
        # A copy even on the CPU: weights read off the checkpoint's memory map would page-fault
        # mid-step from wherever the file lies, and stream ~10% slower than private memory.
        tensor = tensor.to(device=device, dtype=dtype, copy=True)
        if shard is None:
            state[name] = tensor
        else:
            shards.setdefault(name, {})[shard] = tensor
    for name, parts in shards.items():
        state[name] = torch.cat([parts[i] for i in sorted(parts)], dim=0)
    expected = set(model.state_dict().keys())
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ValueError(
            f"checkpoint mismatch: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, assign=True, strict=False)
    model.cos_sin_cache = rotary_cos_sin_cache(config, max_positions).to(device)
    if device.type == "cpu" and not cpu_ops.load():
        gemv_layout(model)  # torch's own linear: the layout its GEMV streams best
    return model.eval().requires_grad_(False)


def gemv_layout(model: torch.nn.Module) -> None:
    """Store each [out, in] projection (and the embedding, which may be the LM head) as the
    transpose of a contiguous [in, out] matrix: `F.linear` then runs a plain `x @ W^T` GEMM
    that streams the weights row by row. On the CPU, batch 1 (GEMV) runs ~1.3x faster this
    way (bench/results/cpu-step.md); larger batches are no slower."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
            transposed = module.weight.detach().t().contiguous().t()
            module.weight = torch.nn.Parameter(transposed, requires_grad=False)
