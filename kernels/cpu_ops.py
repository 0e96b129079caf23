"""The CPU worker's C++ ops (`kernels/csrc/`), registered as `torch.ops.skiff_cpu.*`:

- `linear(x, weight, bias, weight_scale)`: `x @ weight^T + bias` that streams the weight
  (fp32, bf16 or group-scaled int8) at close to the memory bandwidth: a decode step
  multiplies a few token rows by every matrix;
- `decode_layer(...)`: a whole decoder layer of a decode-only step in one call
  (`services/worker/cpu_decode.py`);
- `paged_attention(...)`: a step's tokens against the paged cache
  (`services/worker/attention/cpu_backend.py`);
- `rms_norm`, `rotary_embedding`, `silu_and_mul`: the model's elementwise ops
  (`kernels/ops.py` dispatches CPU fp32 tensors to all but `decode_layer`).

They are compiled on first use with the machine's C++ compiler (torch's extension builder and
ninja) into the cache folder, keyed by the sources and the torch version, so later processes
load them in well under a second. The kernels are built for AVX-512 and for AVX2 with FMA; the
process uses the widest its CPU has (`isa()`). Without a compiler, or on a CPU with neither, the
CPU path keeps torch's own ops.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

from shared.default_model import cache_root

log = logging.getLogger("skiff.kernels.cpu_ops")

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.[ch]*"))
_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_enabled = True


def build_dir() -> Path:
    digest = hashlib.sha256(torch.__version__.encode())
    for source in SOURCES:
        digest.update(source.read_bytes())
    return cache_root() / "cpu-kernels" / digest.hexdigest()[:16]


def load() -> bool:
    """Build (once per sources and torch version) and load the ops; False where they cannot
    run here (no compiler, neither AVX2 nor AVX-512)."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _build_and_load() and bool(isa())
            if _loaded:
                log.info("CPU ops use %s", isa())
        return _loaded


ISAS = ("avx512", "avx2")  # the kernels' instruction sets, widest first


def isa() -> str:
    """The instruction set the loaded ops run with: the widest of `ISAS` this CPU has unless
    `use_isa` picked another; "" where it has none."""
    return str(torch.ops.skiff_cpu.isa())


def use_isa(name: str) -> bool:
    """Run the loaded ops with the kernels of `name` from now on (tests and benchmarks try each
    one); False, and nothing changes, where this CPU lacks it."""
    return bool(torch.ops.skiff_cpu.use_isa(name))


def active() -> bool:
    """The ops are loaded and in use (`use(False)` routes the CPU back to torch's ops)."""
    return bool(_loaded) and _enabled


def use(enabled: bool) -> None:
    """Turn the C++ ops on or off for this process (benchmarks compare both)."""
    global _enabled
    _enabled = enabled


def _build_and_load() -> bool:
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the `ninja` wheel puts it beside the interpreter
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(
            name="skiff_cpu_ops",
            sources=[str(s) for s in SOURCES if s.suffix == ".cpp"],
            build_directory=str(directory),
            extra_cflags=["-O3", "-fopenmp"],
            extra_ldflags=["-fopenmp"],  # resolves to the libgomp torch already loaded
            is_python_module=False,
        )
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, no ninja, build error
        log.warning("CPU ops unavailable, using torch's: %s", exc)
        return False
    return True
