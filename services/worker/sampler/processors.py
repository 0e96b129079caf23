"""Token-level logit processors, in place: allowed-token whitelist, bad words, min_tokens,
logit_bias and the structured-output grammar mask. Each touches only the rows (and, but for the
whitelist and the grammar, only the tokens) it names.
"""

from __future__ import annotations

import torch

from services.worker.sampler.flat import flat_ids
from services.worker.sampler.metadata import Allowed, BadWords, GrammarMask, TokenBias, TokenRows
from services.worker.sampler.topk_topp import on_rows

_NEG_INF = float("-inf")


def apply_allowed_token_ids(
    logits: torch.Tensor, allowed: Allowed, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Every token outside a row's whitelist becomes -inf: in place, or into `out` ([n, vocab],
    only when the whitelist covers all n rows). Returns the result."""
    if out is not None:
        return torch.where(allowed.banned, _neg_inf(logits), logits, out=out)
    on_rows(logits, allowed.rows, lambda x: torch.where(allowed.banned, _neg_inf(x), x, out=x))
    return logits


def apply_bad_words(logits: torch.Tensor, bad: BadWords) -> None:
    """Ban a word's last token when the output so far ends with the rest of the word.

    Single-token words are always banned; a word longer than the output plus one never
    matches (its prefix meets the -2 before the output).
    """
    prefix = bad.words[:, :, :-1]  # [r, num_words, word_len - 1]
    history = bad.history.unsqueeze(1)  # [r, 1, word_len - 1]
    match = ((prefix == -1) | (prefix == history)).all(dim=2)  # [r, num_words]
    row, word = match.nonzero(as_tuple=True)
    logits[bad.rows[row], bad.words[row, word, -1]] = _NEG_INF


def ban_tokens(logits: torch.Tensor, ban: TokenRows) -> None:
    """-inf at each row's listed ids (min_tokens: stop ids and EOS until reached)."""
    flat = flat_ids(ban.rows, ban.token_ids, logits.shape[1])
    logits.put_(flat, _neg_inf(logits).expand(flat.shape))


def apply_logit_bias(logits: torch.Tensor, bias: TokenBias) -> None:
    """Add each row's bias to its listed ids (padding adds 0)."""
    flat = flat_ids(bias.rows, bias.token_ids, logits.shape[1])
    logits.put_(flat, bias.values, accumulate=True)


def apply_grammar_mask(logits: torch.Tensor, mask: GrammarMask, buffer: torch.Tensor) -> None:
    """-inf at each grammar row's disallowed tokens, as one additive bias: each byte of the
    bitmask picks its 8 entries (0 or -inf) from a 256-row table; `buffer` holds at least
    r * words * 32 floats on the logits' device (reused across steps)."""
    r, vocab = len(mask.rows), logits.shape[1]
    byte_ids = mask.bitmask.view(torch.uint8).view(-1).int()  # little-endian: token 8i + bit
    table = _byte_bias(logits.device)
    out = buffer[: byte_ids.numel() * 8].view(-1, 8)
    bias = torch.index_select(table, 0, byte_ids, out=out).view(r, -1)[:, :vocab]
    logits.index_add_(0, mask.rows, bias)


_BYTE_BIAS: dict[torch.device, torch.Tensor] = {}


def _byte_bias(device: torch.device) -> torch.Tensor:
    """[256, 8] fp32: 0 where bit j of byte i is set, else -inf."""
    table = _BYTE_BIAS.get(device)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = _BYTE_BIAS[device] = torch.where(bits.bool(), 0.0, _NEG_INF).to(device)
    return table


def _neg_inf(x: torch.Tensor) -> torch.Tensor:
    return x.new_tensor(_NEG_INF)  # a 0-dim tensor: torch.where(..., out=) wants tensors
