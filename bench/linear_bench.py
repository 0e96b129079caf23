"""µs per call of the CPU linear kernels at decode and prefill sizes: the panel kernel
(`linear_packed`), the row kernel (`linear`) and torch's `F.linear` (on the fp32 weight the
stored one stands for), x [M, K] @ w [N, K]^T with w stored as fp32, bf16 or int8; median (or
least) of repeats. `python -m bench.linear_bench [--threads 2] [--repeats 21]
[--stat median|min] [--weights fp32|bf16|int8]`."""

from __future__ import annotations

import argparse
from functools import partial
from statistics import median

import torch
from torch.nn import functional as F

from kernels import cpu_ops

SHAPES = ((1536, 576), (576, 1536))  # (N, K): SmolLM2-135M's gate/up half and down projection
ROWS = (1, 8, 64, 256)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--stat", choices=("median", "min"), default="median")
    parser.add_argument("--weights", choices=tuple(DTYPES), default="fp32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_ops.load():
        raise SystemExit("the C++ CPU ops do not load here")
    print(f"cpu: {cpu_ops.cpu_model()}, isa {cpu_ops.isa()}, {args.threads} threads")
    print(f"{args.weights} weights")
    stat = median if args.stat == "median" else min
    print(f"{args.stat} µs per call of {args.repeats}\n")
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


if __name__ == "__main__":
    main()
