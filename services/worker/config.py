"""The model runner's configuration: one frozen dataclass, torch-free so that `skiff serve`
and the flags of `skiff worker` can derive from it without loading torch."""

from __future__ import annotations

from dataclasses import dataclass

from shared.cli_args import setting
from shared.config import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class RunnerConfig:
    """Everything a ModelRunner needs; each default is defined here once."""

    model_dir: str  # HF-format checkpoint directory (flag --model)
    kv_cache_gib: float = setting(1.0, "KV cache budget, GiB (when num_blocks is not given)")
    num_blocks: int | None = setting(None, "KV blocks (default: sized from kv_cache_gib)")
    block_size: int = setting(DEFAULT_BLOCK_SIZE, "tokens per KV block")
    max_num_seqs: int = setting(DEFAULT_MAX_NUM_SEQS, "rows of the persistent batch")
    max_model_len: int = setting(
        DEFAULT_MAX_MODEL_LEN, "context length cap (also capped by the model's)"
    )
    device: str = setting("cpu", "torch device: cpu, cuda, cuda:N")
    dtype: str = setting("float32", f"weights and KV cache: {', '.join(DTYPES)}")
    cuda_graphs: bool = setting(True, "decode steps replay captured graphs (CUDA only)")

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 or None, got {self.num_blocks}")
        if not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
