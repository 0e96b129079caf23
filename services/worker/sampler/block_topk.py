"""`torch.topk` (small k) and `torch.argmax` along rows, several times faster on CPU.

The k largest values of a row lie in the k blocks (of 64 consecutive tokens) with the largest
maxima, plus the tail that does not fill a block: one cheap pass of block maxima (`amax` is
vectorized, `topk` and `argmax` are not), then work on k * 64 candidates, copied block by
block. Values are exactly torch.topk's; among tied values the ids may differ (torch.topk does
not promise which tied id it returns either). `argmax` returns the first maximal index, as
torch.argmax does. Where the sampler's C++ ops run, the small top-k selections take
`skiff_cpu::row_topk` (`row_topk`), several times faster than torch.topk on short rows, and
argmax takes `skiff_cpu::row_argmax`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.worker.sampler.logit_stats import fused

_BLOCK = 64


@dataclass
class Candidates:
    """Each row's `num_blocks` blocks with the largest maxima, in that order, then its tail."""

    values: torch.Tensor  # [r, c]
    blocks: torch.Tensor | None  # [r, b] their block ids; None: values is the whole row
    full: int  # tokens in whole blocks: the tail starts here
    floor: torch.Tensor  # [r, 1] every value outside `values` is <= floor (-inf: none is)

    def token_ids(self, picked: torch.Tensor) -> torch.Tensor:
        """[r, m] positions in `values` -> [r, m] token ids."""
        if self.blocks is None:
            return picked
        b = self.blocks.shape[1]
        block = self.blocks.gather(1, (picked // _BLOCK).clamp_(max=b - 1))
        in_blocks = picked < b * _BLOCK
        return torch.where(
            in_blocks, block * _BLOCK + picked % _BLOCK, picked - b * _BLOCK + self.full
        )


def whole_rows(x: torch.Tensor, num_blocks: int) -> bool:
    """Whether `candidates` takes x's whole rows ([r, vocab]): on a GPU, or where num_blocks
    blocks would cover more than a quarter of a row."""
    return x.is_cuda or 4 * num_blocks * _BLOCK > x.shape[1]


def block_maxima(x: torch.Tensor) -> torch.Tensor:
    """x: [r, vocab] -> [r, vocab // 64] the maximum of each whole block of 64 tokens."""
    full = x.shape[1] - x.shape[1] % _BLOCK
    return torch.unflatten(x[:, :full], 1, (-1, _BLOCK)).amax(dim=2)


def candidates(
    x: torch.Tensor,
    num_blocks: int,
    maxima: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> Candidates:
    """x: [n, vocab] -> for x[rows] ([r, vocab]; all rows where None), their num_blocks blocks
    with the largest maxima: they hold the row's num_blocks largest values and every value
    above `floor` (the smallest chosen maximum). The whole row where `whole_rows`. maxima:
    x[rows]'s block_maxima, where already at hand. Blocks come straight from x: no copy of
    whole rows."""
    vocab = x.shape[1]
    if whole_rows(x, num_blocks):
        sub = x if rows is None else x[rows]
        return Candidates(sub, None, vocab, sub.new_full((len(sub), 1), -math.inf))
    full = vocab - vocab % _BLOCK
    if maxima is None:
        maxima = block_maxima(x if rows is None else x[rows])  # [r, full / BLOCK]
    top, blocks = row_topk(maxima, num_blocks)  # [r, num_blocks]
    values = _gather_blocks(x, blocks, full, rows)
    return Candidates(values, blocks, full, top[:, -1:])


def topk(
    x: torch.Tensor,
    k: int,
    maxima: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [n, vocab] -> (values, ids) [r, k] of x[rows] (all rows where None), descending, like
    x[rows].topk(k, dim=1). maxima: x[rows]'s block_maxima, where already at hand."""
    c = candidates(x, k, maxima, rows)
    values, picked = row_topk(c.values, k)  # [r, k]
    return values, c.token_ids(picked)


def row_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [r, n] -> (values, ids) [r, k], x.topk(k, dim=1); where the C++ ops run, theirs (the
    same values; among equal values the lower id first)."""
    if fused(x):
        values, ids = torch.ops.skiff_cpu.row_topk(x, k)
        return values, ids
    top = x.topk(k, dim=1)
    return top.values, top.indices


def _gather_blocks(
    x: torch.Tensor, blocks: torch.Tensor, full: int, rows: torch.Tensor | None
) -> torch.Tensor:
    """[r, k * BLOCK + vocab - full]: each of x[rows]'s blocks ([r, k]) in order, then its tail.

    The blocks are rows of a view of every BLOCK-long window of x; `index_select` copies them
    whole, several times faster than an elementwise gather of [r, k * BLOCK] column ids."""
    r, vocab = blocks.shape[0], x.shape[1]
    x = x.contiguous()
    row_ids = torch.arange(r, device=x.device) if rows is None else rows
    starts = blocks * _BLOCK + row_ids.unsqueeze(1) * vocab  # [r, k]
    windows = x.view(-1).unfold(0, _BLOCK, 1)  # [n * vocab - BLOCK + 1, BLOCK], no copy
    picked = windows.index_select(0, starts.flatten()).view(r, -1)  # [r, k * BLOCK]
    if full == vocab:
        return picked
    return torch.cat((picked, (x if rows is None else x[rows])[:, full:]), dim=1)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x: [r, vocab] -> [r] int64, the first index of each row's maximum (of its first NaN);
    where the C++ ops run, `skiff_cpu::row_argmax`."""
    vocab = x.shape[1]
    if fused(x) and vocab:
        ids: torch.Tensor = torch.ops.skiff_cpu.row_argmax(x)
        return ids
    if x.is_cuda or vocab < 4 * _BLOCK:
        return x.argmax(dim=1)
    full = vocab - vocab % _BLOCK
    maxima = torch.unflatten(x[:, :full], 1, (-1, _BLOCK)).amax(dim=2)  # [r, full / BLOCK]
    best = maxima.max(dim=1, keepdim=True)  # first block holding the maximum
    cols = best.indices * _BLOCK + torch.arange(_BLOCK, device=x.device)  # [r, BLOCK]
    index = cols.gather(1, x.gather(1, cols).argmax(dim=1, keepdim=True)).squeeze(1)
    if full == vocab:
        return index
    tail = x[:, full:].max(dim=1)
    return torch.where(tail.values > best.values.squeeze(1), tail.indices + full, index)
