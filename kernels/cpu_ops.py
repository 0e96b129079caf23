"""The CPU worker's C++ ops (`kernels/csrc/`), registered as `torch.ops.skiff_cpu.*`:

- `linear(x, weight, bias, weight_scale)`: `x @ weight^T + bias` that streams the weight
  (fp32, bf16 or group-scaled int8) at close to the memory bandwidth: a decode step
  multiplies a few token rows by every matrix;
- `linear_packed(x, packed, out_features, bias, scale)`: the same for weights packed in
  panels (`pack_panels`), a register-tiled kernel that also runs prefill chunks near the CPU's
  FMA peak; `linear_choice` says for each weight shape which of the two runs it. Int8 weights
  packed by `pack_q8_panels` run Q8_0 x Q8_0 instead (x quantized per row and group of 32,
  int8 dot products with VNNI or AVX2, `int8_dot_isa`), bf16 weights packed by
  `pack_bf16_panels` bf16 x bf16 (x rounded to bf16, pairs of products summed in fp32 with
  AVX512-BF16 or widened, `bf16_dot_isa`);
- `decode_layers(...)`: every decoder layer of a decode-only step in one call
  (`services/worker/cpu_decode.py`);
- `paged_attention(...)`: a step's tokens against the paged cache
  (`services/worker/attention/cpu_backend.py`);
- `rms_norm`, `rotary_embedding`, `silu_and_mul`: the model's elementwise ops
  (`kernels/ops.py` dispatches CPU fp32 tensors to all but `decode_layers`);
- `logit_stats`, `row_topk` (`kernels/csrc/sampler_ops.cpp`): the sampler's passes over the
  logits, block maxima and logsumexp in one read of each row (with the whitelist-masked copy
  on the way) and small top-k selections (`services/worker/sampler/logit_stats.py`).

They split their work over torch's thread count on a pool of their own
(kernels/csrc/spin_pool.h) whose threads spin for `SKIFF_CPU_SPIN_US` (200) microseconds
after each op before they sleep: a decode step is ~150 short parallel regions, and waking
sleeping threads for each cost most of a single-stream step.

They are compiled on first use with the machine's C++ compiler (torch's extension builder and
ninja) into the cache folder, keyed by the sources and the torch version, so later processes
load them in well under a second. An image can carry them built (docker/worker.Dockerfile):
where `SKIFF_PREBUILT_DIR` holds the library of the same sources and torch, it is loaded
from there and nothing is compiled (a worker pod starts on an empty cache volume). The
kernels are built for AVX-512 and for AVX2 with FMA; the process uses the widest its CPU has
(`isa()`). Without a compiler, or on a CPU with neither, the CPU path keeps torch's own ops.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional as F

from shared.default_model import cache_root, prebuilt_root

log = logging.getLogger("skiff.kernels.cpu_ops")

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.[ch]*"))
LIBRARY = "skiff_cpu_ops"
_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_enabled = True


def build_dir() -> Path:
    digest = hashlib.sha256(torch.__version__.encode())
    for source in SOURCES:
        digest.update(source.read_bytes())
    return cache_root() / "cpu-kernels" / digest.hexdigest()[:16]


def prebuilt_library() -> Path | None:
    """The ops' library of these sources and this torch under `SKIFF_PREBUILT_DIR` (laid out
    as the cache folder), if it holds one."""
    root = prebuilt_root()
    if root is None:
        return None
    library = root / "cpu-kernels" / build_dir().name / f"{LIBRARY}.so"
    return library if library.is_file() else None


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


def int8_dot_isa() -> str:
    """The instructions of the Q8_0 x Q8_0 kernel: "avx512_vnni" (vpdpbusd) where `isa()` is
    avx512 and the CPU has AVX512-VNNI, else "avx2" (vpmaddubsw + vpmaddwd); the same bits."""
    return str(torch.ops.skiff_cpu.int8_dot_isa())


def bf16_dot_isa() -> str:
    """The instructions of the bf16 x bf16 kernel: "avx512_bf16" (vdpbf16ps) where `isa()` is
    avx512 and the CPU has AVX512-BF16, else `isa()` (pairs widened to fp32, two fma each),
    unless `use_bf16_dot_isa` picked another; the same bits."""
    return str(torch.ops.skiff_cpu.bf16_dot_isa())


def use_bf16_dot_isa(name: str) -> bool:
    """Run the bf16 x bf16 kernel with `name` ("avx512_bf16", "avx512", "avx2") while `isa()`
    allows it; False, and nothing changes, where this CPU lacks it."""
    return bool(torch.ops.skiff_cpu.use_bf16_dot_isa(name))


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
    directory.mkdir(parents=True, exist_ok=True)  # the linear choices live here either way
    prebuilt = prebuilt_library()
    if prebuilt is not None:
        torch.ops.load_library(str(prebuilt))  # type: ignore[no-untyped-call]
        return True
    try:
        cpp_extension.load(
            name=LIBRARY,
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


PANEL = 16  # output features per panel: kPanel in kernels/csrc/cpu_kernels.h


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """Weight [N, K] (fp32, bf16 or int8; or int8's scales [N, K / 32]) -> panels
    [ceil(N / 16), K, 16] for `linear_packed`: panel p holds rows [16 p, 16 p + 16) side by
    side for each column, zero past N."""
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, 0, 0, -n % PANEL))  # [16 P, K]
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


Q8_QUAD = 4  # consecutive k of a lane in one 32-bit int8 dot product: kQ8Quad
Q8_GROUP = 32  # x and weights quantized per group of 32 along K: kInt8Group


def pack_q8_panels(weight: torch.Tensor) -> torch.Tensor:
    """Int8 weight [N, K] (|w| <= 127, K % 32 == 0) -> Q8_0 panels [ceil(N / 16), K / 4, 16, 4]
    for `linear_packed`: panel p, quad j, lane c holds w[16 p + c, 4 j : 4 j + 4] (zero past N);
    its scales [N, K / 32] are packed by `pack_panels`."""
    k = weight.shape[1]
    if weight.dtype != torch.int8 or k % Q8_GROUP:
        raise ValueError(f"Q8_0 panels need int8 weights with K % {Q8_GROUP} == 0, got {k}")
    if (weight == -128).any():  # AVX2's sign trick negates weights: -128 has no int8 negation
        raise ValueError("Q8_0 panels need int8 weights in [-127, 127]")
    panels = pack_panels(weight)  # [P, K, 16]
    return panels.view(panels.shape[0], k // Q8_QUAD, Q8_QUAD, PANEL).transpose(2, 3).contiguous()


BF16_PAIR = 2  # consecutive k of a lane in one bf16 dot product: kBf16Pair


def pack_bf16_panels(weight: torch.Tensor) -> torch.Tensor:
    """bf16 weight [N, K] (K even) -> pair panels [ceil(N / 16), K / 2, 16, 2] for
    `linear_packed`'s bf16 x bf16 kernel: panel p, pair j, lane c holds w[16 p + c, 2 j : 2 j +
    2] (zero past N); weights below fp32's normal range become zero (sign kept), as
    AVX512-BF16 reads them."""
    k = weight.shape[1]
    if weight.dtype != torch.bfloat16 or k % BF16_PAIR:
        raise ValueError(f"bf16 pair panels need bf16 weights with an even K: {weight.dtype}, {k}")
    flushed = weight * (weight.abs() >= torch.finfo(torch.float32).tiny)  # [N, K]
    panels = pack_panels(flushed)  # [P, K, 16]
    p = panels.shape[0]
    return panels.view(p, k // BF16_PAIR, BF16_PAIR, PANEL).transpose(2, 3).contiguous()


def unpack_panels(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """panels [P, K, 16] -> the [out_features, K] matrix they were packed from."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features]


# The linear kernel of each weight, by "cpu model | isa | dtype N x K": "panels" or "rows".
# The same for every M (a row's bits must not depend on its batch), so it is chosen once per
# shape, by timing both at a decode step (M = 1) and a prefill chunk (M = 64).
_CHOICE_ROWS = (1, 64)
_choices: dict[str, str] | None = None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown cpu"


def _choice_file() -> Path:
    return build_dir() / "linear-choice.json"


def times_us(fn: Callable[[], object], repeats: int) -> list[float]:
    """µs of each of `repeats` calls of `fn`, after one that warms the caches."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return times


def random_weight(
    n: int, k: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A random weight [n, k] stored as `dtype` (fp32, bf16 or int8) and its int8 group scales
    [n, k / 32] (None for the others)."""
    if dtype == torch.int8:
        return torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n, k // 32) / 64
    return torch.randn(n, k).to(dtype), None


def time_kernels(
    n: int,
    k: int,
    rows: int,
    repeats: int = 9,
    summary: Callable[[list[float]], float] = min,
    weight: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    x: torch.Tensor | None = None,
) -> dict[str, float]:
    """µs of x [rows, k] @ weight [n, k]^T (a weight and its int8 scales, or None; fp32 and x
    random where not given) with each kernel: the `summary` of `repeats` calls (the least by
    default: other processes only add time)."""
    w, scale = random_weight(n, k) if weight is None else weight
    p = pack_panels(w)
    ps = None if scale is None else pack_panels(scale)
    xs = torch.randn(rows, k) if x is None else x
    return {
        "rows": summary(times_us(lambda: torch.ops.skiff_cpu.linear(xs, w, None, scale), repeats)),
        "panels": summary(
            times_us(lambda: torch.ops.skiff_cpu.linear_packed(xs, p, n, None, ps), repeats)
        ),
    }


def linear_choice(n: int, k: int, dtype: torch.dtype = torch.float32) -> str:
    """The kernel for weights [n, k] stored as `dtype` (fp32, bf16, or int8 with group
    scales): "panels" or "rows" (k % 16 != 0 leaves only panels). Timed on first asking for
    this CPU, instruction set, dtype and shape, then read from `linear-choice.json` in the
    build folder. Processes starting together (a prefill and a decode worker, the engine a test
    compares with) time a shape once under a file lock and all read that one choice, so they
    compute the same bits."""
    global _choices
    if k % 16 != 0:
        return "panels"
    key = f"{cpu_model()} | {isa()} | {str(dtype).removeprefix('torch.')} {n}x{k}"
    path = _choice_file()
    with _lock:
        if _choices is not None and key in _choices:
            return _choices[key]
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
            try:
                _choices = dict(json.loads(path.read_text()))
            except (OSError, ValueError):
                _choices = {}
            if key not in _choices:
                _choices[key] = _time_choice(key, n, k, dtype)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(_choices, indent=1, sort_keys=True))
                tmp.replace(path)
        return _choices[key]


def _time_choice(key: str, n: int, k: int, dtype: torch.dtype) -> str:
    ratios = []
    for rows in _CHOICE_ROWS:
        t = time_kernels(n, k, rows, weight=random_weight(n, k, dtype))
        ratios.append(t["panels"] / t["rows"])
    choice = "panels" if statistics.fmean(ratios) < 1 else "rows"
    log.info("linear %s: %s (panels / rows time at M = %s: %s)", key, choice, _CHOICE_ROWS,
             ", ".join(f"{r:.2f}" for r in ratios))  # fmt: skip
    return choice
