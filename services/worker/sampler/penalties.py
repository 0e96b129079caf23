"""Repetition (prompt and output), frequency and presence (output) penalties, vLLM's formulas:

    x = x / r if x > 0 else x * r        for tokens in the prompt or the output
    x = x - f * count - p * (count > 0)  with count = occurrences in the output

Only the tokens that occur in a row's history are touched: gather their logits, penalize,
scatter back. Repeated tokens compute identical values, so duplicate writes agree. Output
counts come from a sorted copy of the output ids (searchsorted), never a [rows, vocab] tensor.
"""

from __future__ import annotations

import torch

from services.worker.sampler.flat import flat_ids
from services.worker.sampler.metadata import Penalties

_NOT_OUTPUT = 2**62  # sorts after every token id and matches none


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
    """[r, L] ids, [r, L] bool -> [r, L] int64: how often each entry's id occurs as output."""
    outputs = torch.where(is_output, ids, torch.full_like(ids, _NOT_OUTPUT)).sort(dim=1).values
    return torch.searchsorted(outputs, ids, right=True) - torch.searchsorted(outputs, ids)
