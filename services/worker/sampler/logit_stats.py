"""Block maxima and logsumexp of raw logits in one read of each row: the C++ CPU op
`skiff_cpu::logit_stats` (kernels/csrc/sampler_ops.cpp), where it runs (`fused`).

Torch takes one pass over a [256, 49152] fp32 batch (50 MB) for the block maxima that
block_topk needs, and another for the logsumexp (subtract, exp, sum); the op reads each row
once from memory and sums its exponentials while the row is still in cache, and it can write
the row's whitelist-masked working copy on the way. Its block maxima are torch's; its
logsumexp is within a few ulp of torch's (its own e^x, a different summation order), not bit
for bit. Elsewhere (a GPU, no C++ ops) the sampler keeps its torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import ops


@dataclass
class LogitStats:
    block_max: torch.Tensor  # [r, vocab // 64] maximum of each whole block of 64 tokens
    lse: torch.Tensor  # [r, 1] logsumexp of each row


def fused(x: torch.Tensor) -> bool:
    """Whether the sampler's C++ ops (`logit_stats`, block_topk.row_topk) run for x ([r, n]):
    fp32 on a CPU with the C++ ops loaded, values contiguous within rows."""
    return ops.use_cpu_ops(x) and x.dim() == 2 and x.stride(1) == 1


def logit_stats(
    x: torch.Tensor, banned: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> LogitStats:
    """x: [r, vocab] fp32 logits (`fused(x)`) -> its LogitStats; with out ([r, vocab],
    contiguous), x with -inf where banned ([r, vocab] bool; None: none) is written into it."""
    mask = None if banned is None else banned.contiguous()
    block_max, lse = torch.ops.skiff_cpu.logit_stats(x, mask, out)
    return LogitStats(block_max, lse)
