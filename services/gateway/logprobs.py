"""Logprobs in the two OpenAI shapes: completions (parallel lists) and chat (`content` entries).

A `TokenLogprobs` holds the sampled token first, then the top alternatives in rank order.
Non-finite values become -9999.0 (as in vLLM) so that responses stay valid JSON.
"""

from __future__ import annotations

import math
from typing import Any

from shared.tokenizer import Tokenizer
from shared.wire import TokenLogprobs

_FLOOR = -9999.0


def _clamp(value: float) -> float:
    return value if math.isfinite(value) and value > _FLOOR else _FLOOR


def _alternatives(lp: TokenLogprobs, num_top: int) -> list[tuple[int, float]]:
    return list(zip(lp.token_ids[1 : 1 + num_top], lp.logprobs[1 : 1 + num_top], strict=False))


def _usable(lp: TokenLogprobs | None) -> TokenLogprobs | None:
    return lp if lp is not None and lp.logprobs else None


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: list[int],
    logprobs: list[TokenLogprobs | None],
    offsets: list[int],
    num_top: int,
) -> dict[str, Any]:
    """`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` for these tokens."""
    names = tokenizer.token_strs(token_ids)
    usable = [_usable(lp) for lp in logprobs]
    alternatives = [_alternatives(lp, num_top) if lp else [] for lp in usable]
    alt_names = iter(tokenizer.token_strs([i for alts in alternatives for i, _ in alts]))
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    for name, lp, alts in zip(names, usable, alternatives, strict=True):
        if lp is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        top = {name: _clamp(lp.logprobs[0])}
        for (_, value), alt_name in zip(alts, alt_names, strict=False):
            top.setdefault(alt_name, _clamp(value))
        token_logprobs.append(top[name])
        top_logprobs.append(top)
    return {
        "tokens": names,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[TokenLogprobs | None], num_top: int
) -> list[dict[str, Any]]:
    """The `logprobs.content` entries of a chat choice (or chunk)."""

    def entry(token_id: int, value: float) -> dict[str, Any]:
        return {
            "token": tokenizer.token_strs([token_id])[0],
            "logprob": _clamp(value),
            "bytes": list(tokenizer.token_bytes(token_id)),
        }

    content = []
    for token_id, lp in zip(token_ids, map(_usable, logprobs), strict=True):
        if lp is None:
            content.append({**entry(token_id, _FLOOR), "top_logprobs": []})
            continue
        content.append(
            {
                **entry(token_id, lp.logprobs[0]),
                "top_logprobs": [entry(i, v) for i, v in _alternatives(lp, num_top)],
            }
        )
    return content


def prompt_logprobs_body(
    tokenizer: Tokenizer, prompt_ids: list[int], logprobs: list[TokenLogprobs | None] | None
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token `{token_id: {logprob, rank, decoded_token}}`
    (None for the first token). Alternatives are ranked by their order."""
    if logprobs is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for token_id, lp in zip(prompt_ids, logprobs, strict=False):
        lp = _usable(lp)
        if lp is None:
            out.append(None)
            continue
        ranked = [
            (token_id, lp.logprobs[0], lp.rank),
            *((i, v, r) for r, (i, v) in enumerate(_alternatives(lp, len(lp.token_ids)), 1)),
        ]
        names = tokenizer.token_strs([i for i, _, _ in ranked])
        entry: dict[str, dict[str, Any]] = {}
        for (i, value, rank), name in zip(ranked, names, strict=True):
            entry.setdefault(
                str(i), {"logprob": _clamp(value), "rank": rank, "decoded_token": name}
            )
        out.append(entry)
    return out
