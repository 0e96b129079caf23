"""`torch.topk` (small k) and `torch.argmax` along rows, several times faster on CPU.

The k largest values of a row lie in the k blocks (of 64 consecutive tokens) with the largest
maxima, plus the tail that does not fill a block: one cheap pass of block maxima (`amax` is
vectorized, `topk` and `argmax` are not), then work on k * 64 candidates. Values are exactly
torch.topk's; among tied values the ids may differ (torch.topk does not promise which tied id
it returns either). `argmax` returns the first maximal index, as torch.argmax does.
"""

from __future__ import annotations

import torch

_BLOCK = 64


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [r, vocab] -> (values, ids) [r, k], descending, like x.topk(k, dim=1)."""
    r, vocab = x.shape
    if x.is_cuda or 4 * k * _BLOCK > vocab:
        return x.topk(k, dim=1)
    full = vocab - vocab % _BLOCK
    maxima = torch.unflatten(x[:, :full], 1, (-1, _BLOCK)).amax(dim=2)  # [r, full / BLOCK]
    blocks = maxima.topk(k, dim=1).indices  # [r, k]
    offsets = torch.arange(_BLOCK, device=x.device)
    cols = (blocks.unsqueeze(2) * _BLOCK + offsets).flatten(1)  # [r, k * BLOCK]
    if full < vocab:
        tail = torch.arange(full, vocab, device=x.device).expand(r, -1)
        cols = torch.cat((cols, tail), dim=1)
    values, picked = x.gather(1, cols).topk(k, dim=1)
    return values, cols.gather(1, picked)


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
