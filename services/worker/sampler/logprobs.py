"""Logprobs of sampled tokens: the sampled token's value and 1-based rank plus the top-k.

Values come from a snapshot of the logits at the requested stage (raw or processed), taken
before the sampler changes them in place. `*_logprobs` modes subtract the row's logsumexp,
`*_logits` modes report the logits themselves. The rank counts tokens whose value is >= the
sampled token's (vLLM's rule), so ties share the worse rank.

The logsumexp is computed last, in place over the values (no [rows, vocab] temporary): the
values are spent by then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.worker.sampler.block_topk import topk

_RANK_WINDOW = 64


@dataclass
class TopLogprobs:
    token_ids: torch.Tensor  # [r, 1 + k] int64, the sampled (or target) token first
    values: torch.Tensor  # [r, 1 + k] fp32
    ranks: torch.Tensor  # [r] int64, 1-based rank of the first token


def top_logprobs(
    values: torch.Tensor, token_ids: torch.Tensor, num_top: int, as_logprobs: torch.Tensor
) -> TopLogprobs:
    """values: [r, vocab] fp32 logits, overwritten; token_ids: [r], as_logprobs: [r] bool ->
    TopLogprobs."""
    num_top = min(num_top, values.shape[1])
    width = min(values.shape[1], max(num_top, _RANK_WINDOW))  # 64: ranks come free for most tokens
    window, window_ids = topk(values, width)  # [r, width] descending
    top_values, top_ids = window[:, :num_top], window_ids[:, :num_top]
    chosen = values.gather(1, token_ids.unsqueeze(1))  # [r, 1]
    out = torch.cat((chosen, top_values), dim=1)  # [r, 1 + k]
    ids = torch.cat((token_ids.unsqueeze(1), top_ids), dim=1)
    ranks = _ranks(values, window, chosen)
    if bool(as_logprobs.any()):
        lse = logsumexp_(values, window[:, :1])
        out = out - torch.where(as_logprobs.unsqueeze(1), lse, torch.zeros_like(lse))
    return TopLogprobs(ids, out, ranks)


def logsumexp_(x: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """x: [r, vocab], row_max: [r, 1] its maxima -> [r, 1], bit for bit
    x.logsumexp(dim=1, keepdim=True) (same steps as ATen's), computed in place: x is
    overwritten."""
    top = row_max.masked_fill(row_max.abs() == math.inf, 0.0)
    return x.sub_(top).exp_().sum(dim=1, keepdim=True).log_().add_(top)


def _ranks(values: torch.Tensor, window: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """[r] count of values >= chosen: from the topk window when the token lies strictly
    inside it, else by a pass over the row."""
    ranks = (window >= chosen).sum(dim=1)
    if window.shape[1] == values.shape[1]:
        return ranks
    outside = torch.nonzero(chosen[:, 0] <= window[:, -1]).squeeze(1)
    if outside.numel():
        ge = values[outside] >= chosen[outside]
        ranks[outside] = ge.view(torch.uint8).sum(dim=1, dtype=torch.int32).long()
    return ranks


def scatter_rows(parts: list[tuple[torch.Tensor, TopLogprobs]], n: int) -> TopLogprobs:
    """Place each (rows, TopLogprobs) part into [n, ...] tensors; other rows hold zeros."""
    width = max(p.token_ids.shape[1] for _, p in parts)
    device = parts[0][1].values.device
    ids = torch.zeros((n, width), dtype=torch.long, device=device)
    values = torch.zeros((n, width), device=device)
    ranks = torch.zeros(n, dtype=torch.long, device=device)
    for rows, part in parts:
        ids[rows] = part.token_ids
        values[rows] = part.values
        ranks[rows] = part.ranks
    return TopLogprobs(ids, values, ranks)
