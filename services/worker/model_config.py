"""The subset of a Hugging Face `config.json` that the supported architectures need, read once
per worker start. Torch-free: a simulated worker (services/worker/sim_runner.py) announces the
same vocabulary, EOS ids and context length without loading torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2)
    qk_norm: bool  # RMSNorm on each head of q and k (Qwen3)
    eos_token_id: int | None
    extra_eos_token_ids: tuple[int, ...]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every token id that ends generation."""
        return () if self.eos_token_id is None else (self.eos_token_id, *self.extra_eos_token_ids)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        architecture = (raw.get("architectures") or ["?"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[architecture]
        rope = raw.get("rope_parameters") or {}
        rope_scaling = raw.get("rope_scaling") or (
            rope if rope.get("rope_type") not in (None, "default") else None
        )
        heads = raw["num_attention_heads"]
        eos_ids = _eos_ids(model_dir, raw)
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta") or raw.get("rope_theta", 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=family == "qwen2" or raw.get("attention_bias", False),
            qk_norm=family == "qwen3",
            eos_token_id=eos_ids[0] if eos_ids else None,
            extra_eos_token_ids=tuple(eos_ids[1:]),
        )


def _eos_ids(model_dir: Path, raw: dict[str, Any]) -> list[int]:
    """EOS from config.json first, then any further ones from generation_config.json."""
    ids: list[int] = []
    sources = [raw]
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        sources.append(json.loads(gen_path.read_text()))
    for source in sources:
        eos = source.get("eos_token_id")
        for token_id in eos if isinstance(eos, list) else [eos]:
            if token_id is not None and token_id not in ids:
                ids.append(token_id)
    return ids
