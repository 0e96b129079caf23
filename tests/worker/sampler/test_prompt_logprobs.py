"""Prompt logprobs over a long prompt: logits are computed a chunk of rows at a time (a
6,000-token prompt's [6000, 49k] fp32 logits would be 1.2 GB), with the values, ranks and
top alternatives of one computation over all rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.sampler import prompt_logprobs as prompt_lp

pytestmark = pytest.mark.unit


def test_long_prompt_logits_in_chunks() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(700, 8, generator=gen)  # [num_tokens, hidden_size]
    head = torch.randn(8, 300, generator=gen) * 3  # [hidden_size, vocab]
    calls: list[int] = []

    def compute_logits(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return h @ head  # [rows, vocab]

    rows = np.arange(1, 700, dtype=np.int64)  # every position but the first, in order
    targets = torch.randint(0, 300, (699,), generator=gen).numpy()
    top = prompt_lp.compute(compute_logits, hidden, rows, targets, num_top=3)

    assert max(calls) <= prompt_lp._ROWS_PER_CHUNK and sum(calls) == 699
    logprobs = torch.log_softmax(hidden[1:] @ head, dim=-1)  # [699, vocab], all at once
    chosen = logprobs.gather(1, torch.from_numpy(targets)[:, None])  # [699, 1]
    torch.testing.assert_close(top.values[:, :1], chosen)
    torch.testing.assert_close(top.values[:, 1:], logprobs.topk(3).values)
    assert torch.equal(top.ranks, (logprobs >= chosen).sum(1))
