"""µs per call of the CPU linear kernels at decode and prefill sizes: the panel kernel
(`linear_packed`), the row kernel (`linear`) and torch's `F.linear` (on the fp32 weight the
stored one stands for), x [M, K] @ w [N, K]^T with w stored as fp32, bf16 or int8; median (or
least) of repeats. `--weights q8_0` times the Q8_0 x Q8_0 kernel (x quantized too, int8 dot
products: `cpu_ops.int8_dot_isa`) against int8 panels and rows (fp32 x) and fp32 panels;
`--weights bf16_dot` the bf16 x bf16 kernel (x rounded to bf16: `cpu_ops.bf16_dot_isa`)
against bf16 panels and rows (fp32 x) and fp32 panels.
`python -m bench.linear_bench [--threads 2] [--repeats 21] [--stat median|min]
[--weights fp32|bf16|int8|q8_0|bf16_dot] [--isa avx512|avx2]` (default: the widest this CPU
has)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from statistics import median

import torch
from torch.nn import functional as F

from bench import roofline
from kernels import cpu_ops

SHAPES = ((1536, 576), (576, 1536))  # (N, K): SmolLM2-135M's gate/up half and down projection
ROWS = (1, 8, 64, 256)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--stat", choices=("median", "min"), default="median")
    parser.add_argument("--weights", choices=(*DTYPES, "q8_0", "bf16_dot"), default="fp32")
    parser.add_argument("--isa", choices=cpu_ops.ISAS, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_ops.load():
        raise SystemExit("the C++ CPU ops do not load here")
    if args.isa and not cpu_ops.use_isa(args.isa):
        raise SystemExit(f"this CPU has no {args.isa}")
    print(f"{roofline.cpu_line()}, {args.threads} threads")
    print(f"{args.weights} weights")
    stat = median if args.stat == "median" else min
    print(f"{args.stat} µs per call of {args.repeats}\n")
    if args.weights in ("q8_0", "bf16_dot"):
        rounded_x_table(args.weights, args.repeats, stat)
        return
    print("| N x K | M | panels | rows | F.linear | rows / panels | F.linear / panels |")
    print("|---|---|---|---|---|---|---|")
    for n, k in SHAPES:
        stored, scale = cpu_ops.random_weight(n, k, DTYPES[args.weights])
        weight = stored.float()  # [N, K] fp32
        if scale is not None:
            weight = (weight.view(n, -1, 32) * scale.unsqueeze(2)).view(n, k)
        for m in ROWS:
            x = torch.randn(m, k)
            t = cpu_ops.time_kernels(n, k, m, args.repeats, stat, (stored, scale), x)
            torch_us = stat(cpu_ops.times_us(partial(F.linear, x, weight), args.repeats))
            cells = (t["panels"], t["rows"], torch_us)
            ratios = (t["rows"] / t["panels"], torch_us / t["panels"])
            print(
                f"| {n} x {k} | {m} | " + " | ".join(f"{c:.0f}" for c in cells) + " | "
                + " | ".join(f"{r:.2f}" for r in ratios) + " |"
            )  # fmt: skip


def rounded_x_table(weights: str, repeats: int, stat: Callable[[list[float]], float]) -> None:
    """Q8_0 (bf16_dot) panels vs int8 (bf16) panels and rows, the same stored weights with fp32
    x, and fp32 panels."""
    fp32_x = "int8" if weights == "q8_0" else "bf16"
    isa = cpu_ops.int8_dot_isa() if weights == "q8_0" else cpu_ops.bf16_dot_isa()
    print(f"{fp32_x} dot products: {isa}\n")
    print(f"| N x K | M | {weights} | {fp32_x} panels | {fp32_x} rows | fp32 panels |", end="")
    print(f" fp32 / {weights} | {fp32_x} / {weights} |")
    print("|---|---|---|---|---|---|---|---|")
    packed_linear = torch.ops.skiff_cpu.linear_packed
    for n, k in SHAPES:
        stored, scale = cpu_ops.random_weight(n, k, DTYPES[fp32_x])
        panel_scale = None if scale is None else cpu_ops.pack_panels(scale)
        pack = cpu_ops.pack_q8_panels if weights == "q8_0" else cpu_ops.pack_bf16_panels
        rounded, panels = pack(stored), cpu_ops.pack_panels(stored)
        fp32 = cpu_ops.pack_panels(torch.randn(n, k))
        for m in ROWS:
            x = torch.randn(m, k)
            cells = [
                stat(cpu_ops.times_us(f, repeats))
                for f in (
                    partial(packed_linear, x, rounded, n, None, panel_scale),
                    partial(packed_linear, x, panels, n, None, panel_scale),
                    partial(torch.ops.skiff_cpu.linear, x, stored, None, scale),
                    partial(packed_linear, x, fp32, n),
                )
            ]
            ratios = (cells[3] / cells[0], min(cells[1:3]) / cells[0])
            print(
                f"| {n} x {k} | {m} | " + " | ".join(f"{c:.0f}" for c in cells) + " | "
                + " | ".join(f"{r:.2f}" for r in ratios) + " |"
            )  # fmt: skip


if __name__ == "__main__":
    main()
