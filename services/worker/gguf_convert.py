"""De-quantize the embedded GGUF model once into a safetensors model directory."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

from shared.default_model import default_gguf_path, default_model_dir, is_prepared


def ensure_default_model(progress: bool = True) -> Path:
    """Return the default model directory, converting the GGUF file on first use."""
    model_dir = default_model_dir()
    if is_prepared(model_dir):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    # Processes starting together (workers of one `skiff serve`, parallel test workers)
    # convert once: the others wait here and find the model prepared.
    with open(model_dir.parent / f".{model_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_prepared(model_dir):
            convert_gguf(default_gguf_path(), model_dir, progress=progress)
    return model_dir


def convert_gguf(gguf_path: Path, model_dir: Path, progress: bool = True) -> None:
    """Load with transformers (which de-quantizes), write fp32 safetensors + config + tokenizer.

    `save_pretrained` refuses GGUF-loaded models, so the state dict is written directly; the
    tied LM head is left out, as in the original checkpoint. Written to a temporary directory
    and renamed, so a crash never leaves a half-written model behind.
    """
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm  # type: ignore[import-untyped]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"preparing {model_dir.name}", disable=not progress, unit="step")
    gguf_dir, gguf_name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    steps.update()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    steps.update()

    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=model_dir.parent))
    os.chmod(tmp, 0o755)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    # save_file writes 0600: the worker image's user reads a copy converted by root at build
    os.chmod(tmp / "model.safetensors", 0o644)
    steps.update()

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(tmp))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(tmp))
    steps.update()
    steps.close()

    if model_dir.exists():
        shutil.rmtree(model_dir)
    os.replace(tmp, model_dir)
