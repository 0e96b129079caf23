"""µs per call of the CPU linear kernels at decode and prefill sizes: the panel kernel
(`linear_packed`), the row kernel (`linear`) and torch's `F.linear`, fp32, x [M, K] @
w [N, K]^T; median (or least) of repeats.
`python -m bench.linear_bench [--threads 2] [--repeats 21] [--stat median|min]`."""

from __future__ import annotations

import argparse
from functools import partial
from statistics import median

import torch
from torch.nn import functional as F

from kernels import cpu_ops

SHAPES = ((1536, 576), (576, 1536))  # (N, K): SmolLM2-135M's gate/up half and down projection
ROWS = (1, 8, 64, 256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--stat", choices=("median", "min"), default="median")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_ops.load():
        raise SystemExit("the C++ CPU ops do not load here")
    print(f"cpu: {cpu_ops.cpu_model()}, isa {cpu_ops.isa()}, {args.threads} threads")
    stat = median if args.stat == "median" else min
    print(f"{args.stat} µs per call of {args.repeats}\n")
    print("| N x K | M | panels | rows | F.linear | rows / panels | F.linear / panels |")
    print("|---|---|---|---|---|---|---|")
    for n, k in SHAPES:
        weight = torch.randn(n, k)
        for m in ROWS:
            x = torch.randn(m, k)
            t = cpu_ops.time_kernels(n, k, m, args.repeats, stat, (weight, None), x)
            torch_us = stat(cpu_ops.times_us(partial(F.linear, x, weight), args.repeats))
            cells = (t["panels"], t["rows"], torch_us)
            ratios = (t["rows"] / t["panels"], torch_us / t["panels"])
            print(
                f"| {n} x {k} | {m} | " + " | ".join(f"{c:.0f}" for c in cells) + " | "
                + " | ".join(f"{r:.2f}" for r in ratios) + " |"
            )  # fmt: skip


if __name__ == "__main__":
    main()
