"""Logprobs of sampled tokens: the sampled token's value and 1-based rank plus the top-k.

Values come from the logits at the requested stage: raw (the sampler's input, left untouched
for them) or processed (a snapshot). `*_logprobs` modes subtract the row's logsumexp,
`*_logits` modes report the logits themselves. The rank counts tokens whose value is >= the
sampled token's (vLLM's rule), so ties share the worse rank.

Both come from the 16 blocks (block_topk) with the largest maxima: the top values, and the
rank of any token above the smallest of those maxima (nothing outside the blocks can count);
other ranks take a pass over the row. The logsumexp runs a few rows at a time through a buffer
that stays in cache (no [rows, vocab] temporary). Given the rows' LogitStats (logit_stats.py),
the block maxima and the logsumexp come from them instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.sampler.block_topk import Candidates, candidates, row_topk, topk
from services.worker.sampler.chunking import logsumexp_with_max
from services.worker.sampler.logit_stats import LogitStats

_RANK_BLOCKS = 16  # blocks of 64 tokens searched for the top values and the sampled token's rank
_TIE_WINDOW = 64


@dataclass
class TopLogprobs:
    token_ids: torch.Tensor  # [r, 1 + k] int64, the sampled (or target) token first
    values: torch.Tensor  # [r, 1 + k] fp32
    ranks: torch.Tensor  # [r] int64, 1-based rank of the first token


def top_logprobs(
    values: torch.Tensor,
    token_ids: torch.Tensor,
    num_top: int,
    as_logprobs: torch.Tensor,
    stats: LogitStats | None = None,
) -> TopLogprobs:
    """values: [r, vocab] fp32 logits; token_ids: [r], as_logprobs: [r] bool; stats: values'
    LogitStats, where at hand -> TopLogprobs."""
    num_top = min(num_top, values.shape[1])
    maxima = None if stats is None else stats.block_max
    cand = candidates(values, max(num_top + 1, _RANK_BLOCKS), maxima)
    head, head_ids = _head(values, cand, num_top)  # [r, <= num_top + 1] descending
    chosen = values.gather(1, token_ids.unsqueeze(1))  # [r, 1]
    out = torch.cat((chosen, head[:, :num_top]), dim=1)  # [r, 1 + k]
    ids = torch.cat((token_ids.unsqueeze(1), head_ids[:, :num_top]), dim=1)
    ranks = _ranks(values, cand, chosen)
    if bool(as_logprobs.any()):
        lse = logsumexp_with_max(values, head[:, :1]) if stats is None else stats.lse
        out = out - torch.where(as_logprobs.unsqueeze(1), lse, torch.zeros_like(lse))
    return TopLogprobs(ids, out, ranks)


def _head(
    values: torch.Tensor, cand: Candidates, num_top: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The num_top + 1 largest values ([r, <= num_top + 1], descending) and their ids.

    Without ties among them, the first num_top ids are the only possible ones; rows with a tie
    take theirs from a window of max(num_top, 64), the tie order these ids always had."""
    head, picked = row_topk(cand.values, min(num_top + 1, cand.values.shape[1]))
    ids = cand.token_ids(picked)
    tied = torch.nonzero(~(head[:, 1:] < head[:, :-1]).all(dim=1)).squeeze(1)  # NaN counts too
    if tied.numel() and num_top:
        width = min(values.shape[1], max(num_top, _TIE_WINDOW))
        ids[tied, :num_top] = topk(values[tied], width)[1][:, :num_top]
    return head, ids


def _ranks(values: torch.Tensor, cand: Candidates, chosen: torch.Tensor) -> torch.Tensor:
    """[r] count of values >= chosen: among the candidates when chosen is above their floor
    (nothing outside them can count), else by a pass over the row."""
    ranks = (cand.values >= chosen).sum(dim=1)
    outside = torch.nonzero(~(chosen[:, 0] > cand.floor[:, 0])).squeeze(1)
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
