"""Prompt logprobs: the logprob of each prompt token given its prefix, from prefill hidden states.

Entry i of a request's list belongs to prompt token i; entry 0 has no prefix and is None. The
hidden state at position q - 1 predicts token q, so a prefill chunk covering positions
[start, end) yields entries start + 1 .. min(end, num_prompt - 1). Entries are sent once, in
order, one part per step: a chunked prompt's list arrives over several steps and the consumer
concatenates the parts; a recompute after preemption sends nothing twice. Values are raw
logprobs (log_softmax of the model's logits in fp32) whatever `logprobs_mode` says.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from services.worker.sampler.logprobs import TopLogprobs, top_logprobs
from shared.wire import TokenLogprobs

_ROWS_PER_CHUNK = 256  # logits rows at a time: a long prompt never holds [len, vocab] at once


def entry_range(num_prompt: int, start: int, num_scheduled: int, sent: int) -> range:
    """Entries to send after computing positions [start, start + num_scheduled).

    Entries below `start + 1` other than those already `sent` have no hidden state this
    step (entry 0, or a prefix the KV cache supplied) and are sent as None.
    """
    return range(sent, min(start + num_scheduled, num_prompt - 1) + 1)


def compute(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    rows: np.ndarray,
    targets: np.ndarray,
    num_top: int,
) -> TopLogprobs:
    """hidden: [num_tokens, hidden_size]; rows, targets: [m] -> logprobs of targets, on CPU."""
    parts = []
    for lo in range(0, len(rows), _ROWS_PER_CHUNK):
        idx = torch.from_numpy(rows[lo : lo + _ROWS_PER_CHUNK]).to(hidden.device)
        tgt = torch.from_numpy(targets[lo : lo + _ROWS_PER_CHUNK]).to(hidden.device)
        logits = compute_logits(hidden[idx]).float()  # [chunk, vocab]
        as_logprobs = torch.ones(len(idx), dtype=torch.bool, device=hidden.device)
        parts.append(top_logprobs(logits, tgt, num_top, as_logprobs))
    return TopLogprobs(
        torch.cat([p.token_ids for p in parts]).cpu(),
        torch.cat([p.values for p in parts]).cpu(),
        torch.cat([p.ranks for p in parts]).cpu(),
    )


def to_lists(top: TopLogprobs, lo: int, hi: int, num_top: int) -> list[TokenLogprobs]:
    """Rows [lo, hi) of `top` as TokenLogprobs with `num_top` alternatives each."""
    ids = top.token_ids[lo:hi, : num_top + 1].tolist()
    values = top.values[lo:hi, : num_top + 1].tolist()
    ranks = top.ranks[lo:hi].tolist()
    return [TokenLogprobs(i, v, r) for i, v, r in zip(ids, values, ranks, strict=True)]
