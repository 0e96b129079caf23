"""(row, token) pairs as element ids of a [n, vocab] tensor viewed as 1-D.

`take` and `put_` on them gather and scatter ~10x faster on CPU than advanced indexing with a
[r, 1] row tensor broadcast against [r, w] token ids (`logits[rows, ids]`), with the same
values.
"""

from __future__ import annotations

import torch


def flat_ids(rows: torch.Tensor, token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """rows: [r], token_ids: [r, w] -> [r, w] element ids row * vocab + token."""
    return rows.unsqueeze(1) * vocab + token_ids
