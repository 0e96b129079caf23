"""The machine's limits, measured in the benchmark's own run: CPU model, family (which names the
results file: `family_slug`), the vector/matrix extensions that matter to an LLM engine and the
ISA skiff's C++ kernels picked, fp32 GEMM GFLOP/s (torch matmul, and skiff's own
`skiff_cpu::linear` at a prefill-like shape) and memory bandwidth (a large tensor copy, bytes
read plus written; and a large tensor sum, bytes read: what bounds a decode step)."""

from __future__ import annotations

import os
import platform
import re
import time
from pathlib import Path

import torch

EXTENSIONS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
VENDORS = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}
BRANDS = ("xeon", "epyc", "threadripper", "ryzen", "core", "opteron")


def cpu_summary(cpuinfo: str | None = None) -> dict[str, object]:
    """Model name, vendor, family and model numbers (None where not listed) and which of
    EXTENSIONS the CPU flags list (from /proc/cpuinfo; its first processor)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())

    def number(key: str) -> int | None:
        return int(fields[key]) if fields.get(key, "").isdigit() else None

    return {
        "model": fields.get("model name") or platform.processor(),
        "vendor": fields.get("vendor_id", ""),
        "family": number("cpu family"),
        "model_number": number("model"),
        **{ext: ext in flags for ext in EXTENSIONS},
    }


def isa_tier(cpu: dict[str, object]) -> str:
    """The widest extension tier the CPU lists: "amx", "avx512" (avx512f), "avx2" (with FMA)
    or "base"."""
    if cpu.get("amx_int8") or cpu.get("amx_bf16"):
        return "amx"
    if cpu.get("avx512f"):
        return "avx512"
    return "avx2" if cpu.get("avx2") and cpu.get("fma") else "base"


def zen_generation(family: int | None, model: int | None) -> str | None:
    """AMD's core generation from the cpuid family and model numbers (None: not a Zen)."""
    if family == 23 and model is not None:  # 0x17
        return "zen2" if model >= 0x30 else "zen1"
    if family == 25 and model is not None:  # 0x19: Zen 4 at models 0x10-1f, 0x60-7f, 0xa0-af
        return "zen4" if model >> 4 in (0x1, 0x6, 0x7, 0xA) else "zen3"
    return "zen5" if family == 26 else None  # 0x1a


def family_slug(cpu: dict[str, object]) -> str:
    """The CPU family a results file is named for: vendor, brand, AMD's Zen generation where
    the family numbers give it, and `isa_tier` (a VM that hides AVX-512 from a Zen 4 runs other
    kernels, so it gets its own file), e.g. "intel-xeon-amx", "amd-epyc-zen4-avx512"."""
    vendor = str(cpu.get("vendor", ""))
    parts = [VENDORS.get(vendor) or re.sub(r"[^a-z0-9]+", "", vendor.lower()) or "unknown"]
    words = re.findall(r"[a-z0-9]+", str(cpu.get("model", "")).lower())
    parts.append(next((b for b in BRANDS if b in words), "cpu"))
    if parts[0] == "amd":
        family, model = cpu.get("family"), cpu.get("model_number")
        zen = zen_generation(
            family if isinstance(family, int) else None, model if isinstance(model, int) else None
        )
        parts += [zen] if zen else []
    return "-".join([*parts, isa_tier(cpu)])


def results_path(cpu: dict[str, object], suffix: str) -> Path:
    """bench/results/cpu-<family_slug><suffix>: one results file per CPU family."""
    return Path(__file__).resolve().parent / "results" / f"cpu-{family_slug(cpu)}{suffix}"


Isas = tuple[str | None, str | None, str | None]  # kernels, int8 dot, bf16 dot


def cpu_line(cpu: dict[str, object] | None = None, isas: Isas | None = None) -> str:
    """One line naming the CPU, the extensions of EXTENSIONS it has and the ISA of skiff's C++
    kernels (`cpu_ops.isa()`, `int8_dot_isa()`, `bf16_dot_isa()`; `kernel_isas()` where not
    given)."""
    cpu = cpu_summary() if cpu is None else cpu
    isa, int8_isa, bf16_isa = kernel_isas() if isas is None else isas
    numbers = f"family {cpu.get('family')} model {cpu.get('model_number')}"
    has = " ".join(ext for ext in EXTENSIONS if cpu.get(ext)) or "none of " + ", ".join(EXTENSIONS)
    kernels = (
        f"skiff kernels {isa}, int8 dot {int8_isa}, bf16 dot {bf16_isa}"
        if isa
        else "skiff C++ kernels off"
    )
    return (
        f"cpu: {cpu.get('model')} ({cpu.get('vendor') or 'vendor unknown'}, {numbers}; "
        f"family {family_slug(cpu)}), extensions: {has}; {kernels}"
    )


def _best_seconds(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def gemm_gflops(n: int = 1024, repeats: int = 5) -> float:
    """fp32 n x n x n matmul throughput, best of `repeats`."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    t = _best_seconds(lambda: torch.matmul(a, b, out=out), repeats)
    return 2 * n**3 / t / 1e9


def kernel_isas() -> Isas:
    """The instruction sets skiff's C++ CPU ops run with here: `cpu_ops.isa()`, the Q8_0
    dot's `cpu_ops.int8_dot_isa()` and the bf16 dot's `cpu_ops.bf16_dot_isa()` (all None: the
    ops do not run here)."""
    from kernels import cpu_ops

    if not cpu_ops.load():
        return None, None, None
    return cpu_ops.isa(), cpu_ops.int8_dot_isa(), cpu_ops.bf16_dot_isa()


def cpu_linear_gflops(tokens: int = 256, n: int = 1024, repeats: int = 5) -> float | None:
    """fp32 `skiff_cpu::linear` of [tokens, n] x [n, n] (None: the C++ ops do not run here)."""
    from kernels import cpu_ops

    if not cpu_ops.load():
        return None
    x, w = torch.randn(tokens, n), torch.randn(n, n)
    t = _best_seconds(lambda: torch.ops.skiff_cpu.linear(x, w), repeats)
    return 2 * tokens * n * n / t / 1e9


def read_bandwidth_gbs(mib: int = 512, repeats: int = 5) -> float:
    """GB/s of summing a `mib` MiB fp32 tensor (read only), best of `repeats`."""
    src = torch.ones(mib * 2**20 // 4)
    t = _best_seconds(src.sum, repeats)
    return src.numel() * 4 / t / 1e9


def copy_bandwidth_gbs(mib: int = 512, repeats: int = 5) -> float:
    """GB/s of copying a `mib` MiB fp32 tensor (read + write), best of `repeats`."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    t = _best_seconds(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * 4 / t / 1e9


def measure() -> dict[str, object]:
    """Everything above, plus the 1-minute load average (others' work on a shared machine)."""
    cpu = cpu_summary()
    isa, int8_isa, bf16_isa = kernel_isas()
    return {
        "cpu": cpu,
        "family_slug": family_slug(cpu),
        "kernels_isa": isa,
        "int8_dot_isa": int8_isa,
        "bf16_dot_isa": bf16_isa,
        "load_average_1m": os.getloadavg()[0],
        "torch_threads": torch.get_num_threads(),
        "fp32_gemm_gflops": gemm_gflops(),
        "cpu_linear_gflops": cpu_linear_gflops(),
        "copy_bandwidth_gbs": copy_bandwidth_gbs(),
        "read_bandwidth_gbs": read_bandwidth_gbs(),
    }
