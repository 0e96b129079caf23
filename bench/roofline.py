"""The machine's limits, measured in the benchmark's own run: CPU model and the vector/matrix
extensions that matter to an LLM engine, fp32 GEMM GFLOP/s (torch matmul, and skiff's own
`skiff_cpu::linear` at a prefill-like shape) and memory bandwidth (a large tensor copy, bytes
read plus written; and a large tensor sum, bytes read: what bounds a decode step)."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch

EXTENSIONS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_summary(cpuinfo: str | None = None) -> dict[str, object]:
    """Model name and which of EXTENSIONS the CPU flags list (from /proc/cpuinfo)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = platform.processor(), set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    return {"model": model, **{ext: ext in flags for ext in EXTENSIONS}}


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


def kernels_isa() -> str | None:
    """The instruction set the C++ CPU ops run with here (None: they do not run here)."""
    from kernels import cpu_ops

    return cpu_ops.isa() if cpu_ops.load() else None


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
    return {
        "cpu": cpu_summary(),
        "kernels_isa": kernels_isa(),
        "load_average_1m": os.getloadavg()[0],
        "torch_threads": torch.get_num_threads(),
        "fp32_gemm_gflops": gemm_gflops(),
        "cpu_linear_gflops": cpu_linear_gflops(),
        "copy_bandwidth_gbs": copy_bandwidth_gbs(),
        "read_bandwidth_gbs": read_bandwidth_gbs(),
    }
