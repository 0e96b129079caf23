"""Compile every Triton kernel for a CUDA architecture without a GPU.

    TRITON_INTERPRET=0 python -m kernels.compile_check [--arch 90]

The interpreter checks what the kernels compute, not whether Triton can compile them (loop-
carried types, early returns, layouts): this runs the whole compiler (down to a cubin, with
the ptxas that ships in the Triton wheel) on the specializations the wrappers launch, with the
16-byte alignment hints Triton derives at run time, and prints registers and shared memory.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Protocol

from kernels._checks import next_pow2

F32_ARGS = {"eps", "scale_log2"}
INDEX_PTRS = {"positions_ptr", "slot_mapping_ptr", "query_start_loc_ptr", "seq_lens_ptr",
              "block_table_ptr", "indices_ptr"}  # fmt: skip
F32_PTRS = {"cos_sin_ptr", "lse_ptr", "partial_ptr", "buffer_ptr"}
# (head_dim, group, BLOCK_Q, BLOCK_M, NUM_SPLITS, num_warps): decode, prefill, split decode with
# a non-power-of-two head, prefill with a non-power-of-two group
ATTENTION_TILINGS = ((128, 4, 1, 16, 1, 4), (128, 4, 16, 64, 1, 8), (80, 4, 1, 16, 4, 4),
                     (64, 3, 21, 64, 1, 8))  # fmt: skip
Constexprs = dict[str, int | str | None]
Spec = tuple["Kernel", str, Constexprs, int]  # (kernel, element type, constexprs, num_warps)


class Kernel(Protocol):
    """What this check reads of a `triton.jit` function."""

    __name__: str
    arg_names: list[str]


def specializations() -> list[Spec]:
    """(kernel, element type, constexprs, num_warps) for the variants the wrappers launch."""
    from kernels import activation, kv_cache, lora, paged_attention, rms_norm, rotary

    pa = paged_attention._paged_attention_kernel
    specs: list[Spec] = []
    for ty in ("bf16", "fp16", "fp32"):
        specs += [
            (activation._silu_and_mul_kernel, ty, {"BLOCK": 1024}, 4),
            (rms_norm._rms_norm_kernel, ty, {"HAS_RESIDUAL": True, "BLOCK": 4096}, 16),
            (rms_norm._rms_norm_kernel, ty, {"HAS_RESIDUAL": False, "BLOCK": 1024}, 4),
            (rotary._rotary_kernel, ty, {"HEAD_DIM": 80, "ROT_HALF": 16, "BLOCK_H": 32,
                                         "BLOCK_HALF": 16, "BLOCK_D": 128}, 4),
            (kv_cache._write_kv_kernel, ty, {"BLOCK_SIZE": 16, "BLOCK_H": 8, "BLOCK_D": 128}, 4),
            (lora._shrink_kernel, ty, {"BLOCK_R": 16, "BLOCK_K": 256}, 4),
            (lora._shrink_kernel, ty, {"BLOCK_R": 64, "BLOCK_K": 64}, 4),
            (lora._expand_kernel, ty, {"BLOCK_R": 16, "BLOCK_N": 256}, 4),
            (lora._expand_kernel, ty, {"BLOCK_R": 64, "BLOCK_N": 64}, 4),
        ]  # fmt: skip
        precision = "ieee" if ty == "fp32" else None
        tilings = ATTENTION_TILINGS if ty == "bf16" else ATTENTION_TILINGS[:1]
        for head_dim, group, block_q, block_m, splits, warps in tilings:
            specs.append((pa, ty, {
                "GROUP": group, "HEAD_DIM": head_dim, "HEAD_DIM_PAD": next_pow2(head_dim),
                "BLOCK_SIZE": 16, "BLOCK_Q": block_q, "BLOCK_M": block_m, "TILE_N": 64,
                "NUM_SPLITS": splits, "PRECISION": precision}, warps))  # fmt: skip
        specs.append((paged_attention._merge_splits_kernel, ty, {
            "HEAD_DIM": 80, "HEAD_DIM_PAD": 128, "NUM_SPLITS": 4, "SPLITS_PAD": 4}, 4))  # fmt: skip
    return specs


def signature(
    fn: Kernel, ty: str, constexprs: Constexprs
) -> tuple[dict[str, str], dict[tuple[int], list[list[str | int]]]]:
    """Argument types by naming convention, and alignment hints on pointers and strides."""
    sig: dict[str, str] = {}
    attrs: dict[tuple[int], list[list[str | int]]] = {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            sig[name] = "*i32" if name in INDEX_PTRS else "*fp32" if name in F32_PTRS else f"*{ty}"
        else:
            sig[name] = "fp32" if name in F32_ARGS else "i32"
        if name.endswith("_ptr") or (name.startswith("stride") and name != "stride_table"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    num_splits = constexprs.get("NUM_SPLITS", 1)
    if "out_ptr" in sig and isinstance(num_splits, int) and num_splits > 1:
        sig["out_ptr"] = "*fp32"  # split partials
    return sig, attrs


def resource_usage(cubin: bytes) -> str:
    import triton.backends.nvidia as nvidia  # type: ignore[import-untyped]

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True)
    found = re.search(r"REG:(\d+) STACK:(\d+)", out.stdout)
    return f"{found[1]} registers, {found[2]} B stack" if found else "registers ?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("set TRITON_INTERPRET=0: the interpreter has nothing to compile", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget  # type: ignore[import-untyped]
    from triton.compiler import ASTSource  # type: ignore[import-untyped]

    target = GPUTarget("cuda", args.arch, 32)
    for fn, ty, constexprs, warps in specializations():
        sig, attrs = signature(fn, ty, constexprs)
        kernel = triton.compile(
            ASTSource(fn, sig, constexprs, attrs), target=target, options={"num_warps": warps}
        )
        knobs = " ".join(f"{k}={v}" for k, v in constexprs.items())
        usage = resource_usage(kernel.asm["cubin"])
        print(f"{fn.__name__} {ty} {knobs}: {usage}, {kernel.metadata.shared} B shared")
    return 0


if __name__ == "__main__":
    sys.exit(main())
