"""`make bench` LoRA section: the reference workload on the offline engine with its requests
spread over 1, 4 and 16 LoRA adapters (rank 16 on all seven projections, 16 slots), against
the same engine with no adapter (base only), in the same run; and the time to read one
adapter into a slot. The last line is `lora throughput ratio 16 adapters / base: X.XX`.

Adapters are written here in PEFT's format (adapter_config.json and
adapter_model.safetensors) with random weights: their values do not change the work.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.offline import LLM, SamplingParams
from services.worker.lora.targets import TARGETS, target_shape
from services.worker.model_config import ModelConfig
from shared.wire import LoRARequest

RANK = 16
ADAPTER_COUNTS = (1, 4, 16)


def write_adapter(
    root: Path, name: str, mc: ModelConfig, rank: int, seed: int, b_scale: float = 0.01
) -> LoRARequest:
    """A random rank-`rank` PEFT adapter of every projection of `mc`'s layers (lora_B drawn
    with standard deviation `b_scale`)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(mc.num_hidden_layers):
        for target, (module, _) in TARGETS.items():
            fan_in, fan_out = target_shape(mc, target)
            key = f"base_model.model.model.layers.{layer}.{module.split('.')[0]}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * b_scale
    path = root / name
    path.mkdir(parents=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS),
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return LoRARequest(lora_name=name, lora_path=str(path))


def _rate(
    llm: LLM, prompts: list[list[int]], outputs: list[int], loras: list[LoRARequest | None]
) -> float:
    """Output tokens per second of the workload, each prompt with its adapter."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    results = llm.generate(prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - start
    assert sum(len(r.outputs[0].token_ids) for r in results) == sum(outputs)
    return sum(outputs) / elapsed


def run(prompts: list[list[int]], outputs: list[int], rounds: int = 2) -> dict[str, float]:
    """Throughput of base only and of each adapter count (best of `rounds`, taking turns),
    the ratios to base, and the load time of one adapter (ms)."""
    llm = LLM(
        enable_lora=True,
        max_loras=max(ADAPTER_COUNTS),
        max_lora_rank=RANK,
        enable_prefix_caching=False,
    )
    mc = llm.runner.model_config
    assert llm.runner.lora is not None
    with tempfile.TemporaryDirectory(prefix="skiff-bench-lora-") as tmp:
        adapters = [
            write_adapter(Path(tmp), f"a{i}", mc, RANK, i) for i in range(max(ADAPTER_COUNTS))
        ]
        start = time.perf_counter()
        llm.runner.lora.load(adapters[0])
        load_ms = (time.perf_counter() - start) * 1e3
        spreads: dict[str, list[LoRARequest | None]] = {"base": [None] * len(prompts)}
        for n in ADAPTER_COUNTS:
            spreads[f"{n} adapters"] = [adapters[i % n] for i in range(len(prompts))]
        _rate(llm, prompts[:4], [4] * 4, spreads[f"{max(ADAPTER_COUNTS)} adapters"][:4])  # warm
        rates = dict.fromkeys(spreads, 0.0)
        for _ in range(rounds):
            for name, loras in spreads.items():
                rates[name] = max(rates[name], _rate(llm, prompts, outputs, loras))
    llm.close()
    result = {f"{name} tok/s": rate for name, rate in rates.items()}
    for n in ADAPTER_COUNTS:
        result[f"{n} adapters / base"] = rates[f"{n} adapters"] / rates["base"]
    result["adapter load ms"] = load_ms
    print(f"\nLoRA (rank {RANK}, all projections, {max(ADAPTER_COUNTS)} slots, in process):")
    for name, rate in rates.items():
        print(f"  {name:<12} {rate:8.1f} tok/s  {rate / rates['base']:.2f}x base")
    print(f"  adapter load (rank {RANK}, {mc.num_hidden_layers} layers): {load_ms:.0f} ms")
    print(f"lora throughput ratio 16 adapters / base: {result['16 adapters / base']:.2f}")
    return result
