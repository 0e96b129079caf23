"""`torch.topk` (small k) and `torch.argmax` along rows, several times faster on CPU.

The k largest values of a row lie in the k blocks (of 64 consecutive tokens) with the largest
maxima, plus the tail that does not fill a block: one cheap pass of block maxima (`amax` is
vectorized, `topk` and `argmax` are not), then work on k * 64 candidates, copied block by
block. Values are exactly torch.topk's; among tied values the ids may differ (torch.topk does
not promise which tied id it returns either). `argmax` returns the first maximal index, as
torch.argmax does.
"""

from __future__ import annotations

import torch

_BLOCK = 64


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [r, vocab] -> (values, ids) [r, k], descending, like x.topk(k, dim=1)."""
    vocab = x.shape[1]
    if x.is_cuda or 4 * k * _BLOCK > vocab:
        return x.topk(k, dim=1)
    full = vocab - vocab % _BLOCK
    maxima = torch.unflatten(x[:, :full], 1, (-1, _BLOCK)).amax(dim=2)  # [r, full / BLOCK]
    blocks = maxima.topk(k, dim=1).indices  # [r, k]
    values, picked = _candidates(x, blocks, full).topk(k, dim=1)  # [r, k]
    in_blocks = picked < k * _BLOCK
    block = blocks.gather(1, (picked // _BLOCK).clamp_(max=k - 1))
    ids = torch.where(in_blocks, block * _BLOCK + picked % _BLOCK, picked - k * _BLOCK + full)
    return values, ids


def _candidates(x: torch.Tensor, blocks: torch.Tensor, full: int) -> torch.Tensor:
    """[r, k * BLOCK + vocab - full]: each row's `blocks` ([r, k]) in order, then its tail.

    The blocks are rows of a view of every BLOCK-long window of x; `index_select` copies them
    whole, several times faster than an elementwise gather of [r, k * BLOCK] column ids."""
    r, vocab = x.shape
    x = x.contiguous()
    starts = blocks * _BLOCK + torch.arange(r, device=x.device).unsqueeze(1) * vocab  # [r, k]
    windows = x.view(-1).unfold(0, _BLOCK, 1)  # [r * vocab - BLOCK + 1, BLOCK], no copy
    picked = windows.index_select(0, starts.flatten()).view(r, -1)  # [r, k * BLOCK]
    return picked if full == vocab else torch.cat((picked, x[:, full:]), dim=1)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x: [r, vocab] -> [r] int64, the first index of each row's maximum."""
    vocab = x.shape[1]
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
