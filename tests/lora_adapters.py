"""Random PEFT LoRA adapters of the embedded SmolLM2 for the tests, saved as peft saves them,
with transformers' model of each merged into the weights as their reference."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from shared.wire import LoRARequest

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_adapters(
    base: Any, root: Path, specs: dict[str, dict[str, Any]], seed: int = 0
) -> dict[str, tuple[LoRARequest, Any]]:
    """Each adapter of `specs` (name -> LoraConfig arguments) saved under `root`/name, its
    lora_B random (peft starts it at zero: the adapter would change nothing), and
    transformers' model with it merged into the weights. The same `seed`, the same weights
    (lora_A too, whatever the global generator's state)."""
    from peft import LoraConfig, get_peft_model

    g = torch.Generator().manual_seed(seed)
    out: dict[str, tuple[LoRARequest, Any]] = {}
    for i, (name, kwargs) in enumerate(specs.items()):
        torch.manual_seed(seed * 1000 + i)  # peft draws lora_A from the global generator
        peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(**kwargs))
        for param_name, param in peft_model.named_parameters():
            if "lora_B" in param_name:
                param.data = torch.randn(param.shape, generator=g) * 0.1
        path = root / name
        peft_model.save_pretrained(path)
        merged = peft_model.merge_and_unload().eval()
        out[name] = (LoRARequest(lora_name=name, lora_path=str(path)), merged)
    return out


def assert_greedy(model: Any, prompt: list[int], tokens: list[int]) -> None:
    """`tokens` is transformers' greedy continuation of `prompt`: at each position of
    prompt + tokens the model's argmax is the next token (one forward, no decode loop)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    assert logits.argmax(-1).tolist() == tokens
