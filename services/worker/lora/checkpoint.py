"""A PEFT LoRA checkpoint (`adapter_config.json`, `adapter_model.safetensors`), read and
checked against the model: anything the worker cannot run exactly is a `LoRAError` saying
why, before a slot is touched."""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from services.worker.lora.errors import LoRAError
from services.worker.lora.targets import TARGETS, target_shape
from services.worker.model_config import ModelConfig
from shared.wire import LoRARequest

log = logging.getLogger("skiff.worker")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ALL_LINEAR = "all-linear"  # PEFT's target_modules for every linear layer but the LM head
# base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
_EMBEDDING_KEYS = ("embed_tokens", "lm_head", "lora_embedding")
# PEFT options whose non-default value changes the computation in ways we do not run
_UNSUPPORTED_OPTIONS = {
    "fan_in_fan_out": "fan_in_fan_out (transposed weights)",
    "use_dora": "use_dora (DoRA)",
    "lora_bias": "lora_bias (a bias on lora_B)",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
}

# (layer, PEFT target) -> (lora_a [rank, in], lora_b [out, rank] times the scaling), fp32
AdapterWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter read off its checkpoint, its scaling folded into each lora_b."""

    name: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    weights: AdapterWeights


def read_adapter(
    lora: LoRARequest, mc: ModelConfig, max_rank: int, base_model: str = ""
) -> LoRAAdapter:
    """The adapter `lora` for the model `mc` (whose checkpoint directory is `base_model`: an
    adapter trained on another names it in base_model_name_or_path, a logged warning)."""
    name, directory = lora.lora_name, Path(lora.lora_path)
    if lora.root:
        _check_confined(directory, Path(lora.root))
    config = _read_config(directory)
    rank, scaling, targets = _check_config(config, max_rank)
    trained_on = config.get("base_model_name_or_path") or ""
    if trained_on and base_model and Path(trained_on).name != Path(base_model).name:
        log.warning(
            "LoRA adapter %s was trained on %s, this worker serves %s", name, trained_on, base_model
        )
    weights = _read_weights(directory / WEIGHTS_FILE, mc, rank, scaling, targets)
    return LoRAAdapter(name, rank, scaling, weights)


def _check_confined(directory: Path, root: Path) -> None:
    """The checkpoint's directory and files, symlinks followed, lie inside `root`."""
    real_root = root.resolve()
    for path in (directory, directory / CONFIG_FILE, directory / WEIGHTS_FILE):
        if not path.resolve().is_relative_to(real_root):
            raise LoRAError(f"{path} leads outside the adapter root (a symlink out of it)")


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoRAError(f"no {CONFIG_FILE} in {directory}") from None
    except (OSError, ValueError) as exc:
        raise LoRAError(f"unreadable {path}: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{path} is not a JSON object")
    return config


def _check_config(config: dict[str, Any], max_rank: int) -> tuple[int, float, set[str] | None]:
    """(rank, scaling, the PEFT targets it names, None for a pattern)."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"peft_type {peft_type!r} is not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"rank {rank} is above this worker's max_lora_rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoRAError(f"lora_alpha must be a number, got {alpha!r}")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"bias {config['bias']!r} is not supported (only 'none')")
    for option, what in _UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            raise LoRAError(f"{what} is not supported")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scaling, _check_targets(config.get("target_modules"))


def _check_targets(target_modules: Any) -> set[str] | None:
    """The targets a list names (each a module name or a dotted path ending in one), None
    for PEFT's regex string (checked on the tensors instead)."""
    if isinstance(target_modules, str):
        if target_modules != ALL_LINEAR:
            try:
                re.compile(target_modules)
            except re.error as exc:
                raise LoRAError(f"target_modules {target_modules!r} is no regex: {exc}") from None
        return None
    if not isinstance(target_modules, list) or not target_modules:
        raise LoRAError(f"target_modules must be a non-empty list or string: {target_modules!r}")
    targets = {str(t).rsplit(".", 1)[-1] for t in target_modules}
    unknown = sorted(targets - TARGETS.keys())
    if unknown:
        raise LoRAError(f"unknown target modules {unknown}: supported are {', '.join(TARGETS)}")
    return targets


def _read_weights(
    path: Path, mc: ModelConfig, rank: int, scaling: float, targets: set[str] | None
) -> AdapterWeights:
    try:
        tensors = load_file(path)
    except FileNotFoundError:
        raise LoRAError(f"no {WEIGHTS_FILE} in {path.parent}") from None
    except (OSError, SafetensorError) as exc:
        raise LoRAError(f"unreadable {path}: {exc}") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, target, half = _parse_key(key, mc, targets)
        halves.setdefault((layer, target), {})[half] = tensor
    if not halves:
        raise LoRAError(f"{path} holds no LoRA weights")
    weights: AdapterWeights = {}
    for (layer, target), pair in sorted(halves.items()):
        where = f"layer {layer} {target}"
        if pair.keys() != {"A", "B"}:
            raise LoRAError(f"{where}: lora_{'B' if 'A' in pair else 'A'} is missing")
        in_features, out_features = target_shape(mc, target)
        a, b = pair["A"], pair["B"]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise LoRAError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                f"model (expected {(rank, in_features)} and {(out_features, rank)})"
            )
        weights[layer, target] = (a.float(), b.float() * scaling)
    return weights


def _parse_key(key: str, mc: ModelConfig, targets: set[str] | None) -> tuple[int, str, str]:
    """(layer, PEFT target, "A" or "B") of a tensor name."""
    match = _KEY.match(key)
    if match is None:
        if any(part in key for part in _EMBEDDING_KEYS):
            raise LoRAError(f"{key}: embedding and LM head adapters are not supported")
        raise LoRAError(f"unsupported tensor {key}")
    layer, parent, target, half = match.groups()
    if target not in TARGETS or not TARGETS[target][0].startswith(parent + "."):
        raise LoRAError(f"{key}: unknown target module {parent}.{target}")
    if targets is not None and target not in targets:
        raise LoRAError(f"{key}: {target} is not among target_modules")
    if int(layer) >= mc.num_hidden_layers:
        raise LoRAError(f"{key}: the model has {mc.num_hidden_layers} layers")
    return int(layer), target, half
