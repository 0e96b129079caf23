"""Repetition (prompt and output), frequency and presence (output) penalties, vLLM's formulas:

    x = x / r if x > 0 else x * r        for tokens in the prompt or the output
    x = x - f * count - p * (count > 0)  with count = occurrences in the output

Only the tokens that occur in a row's history are touched: gather their logits, penalize,
scatter back. Repeated tokens compute identical values, so duplicate writes agree. Output
counts come from each row's history sorted (runs of equal ids), never a [rows, vocab] tensor.
"""

from __future__ import annotations

import torch

from services.worker.sampler.flat import flat_ids
from services.worker.sampler.metadata import Penalties


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> None:
    ids = pen.token_ids  # [r, max_len]
    flat = flat_ids(pen.rows, ids, logits.shape[1])
    x = logits.take(flat)  # [r, max_len]
    counts = output_counts(ids, pen.is_output).to(x.dtype)
    rep = pen.repetition.unsqueeze(1)
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - pen.frequency.unsqueeze(1) * counts - pen.presence.unsqueeze(1) * (counts > 0)
    logits.put_(flat, x)


def output_counts(ids: torch.Tensor, is_output: torch.Tensor) -> torch.Tensor:
    """[r, L] ids, [r, L] bool -> [r, L] int64: how often each entry's id occurs as output.

    Sorted, equal ids form runs; a run's outputs are the running count of outputs at its end
    less that before its start."""
    r, length = ids.shape
    sorted_ids, order = ids.sort(dim=1, stable=True)  # [r, L]
    is_out = is_output.gather(1, order).long()
    upto = is_out.cumsum(dim=1)  # [r, L] outputs up to each sorted entry, itself included
    pos = torch.arange(length, device=ids.device).expand(r, -1)
    new = sorted_ids[:, 1:] != sorted_ids[:, :-1]  # [r, L - 1]: entry j + 1 starts a run
    edge = torch.ones((r, 1), dtype=torch.bool, device=ids.device)
    start = torch.where(torch.cat((edge, new), dim=1), pos, 0).cummax(dim=1).values
    ends = torch.cat((new, edge), dim=1)
    end = torch.where(ends, pos, length).flip(1).cummin(dim=1).values.flip(1)
    counts = upto.gather(1, end) - (upto - is_out).gather(1, start)  # [r, L] sorted order
    return torch.empty_like(counts).scatter_(1, order, counts)
