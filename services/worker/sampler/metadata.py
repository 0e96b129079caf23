"""Per-step sampling parameters of the rows being sampled, as batch tensors.

Every optional feature is None when no row of the step uses it, so the sampler skips it at no
cost. Row indices (`rows`) index the step's sampled rows 0..n-1 (not persistent-batch rows),
ascending; a subset that covers every row lets a step work in place without gathering.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.sampling_params import is_greedy


@dataclass
class TokenRows:
    """Token ids for some rows."""

    rows: torch.Tensor  # [r] int64
    token_ids: torch.Tensor  # [r, width] int64; short rows repeat their first id


@dataclass
class TokenBias(TokenRows):
    """Token ids with a value per id (logit_bias) for some rows."""

    values: torch.Tensor  # [r, width] fp32; 0 where padded


@dataclass
class BadWords:
    rows: torch.Tensor  # [r] int64
    words: torch.Tensor  # [r, num_words, word_len] int64, right-aligned, -1 = no constraint
    history: torch.Tensor  # [r, word_len - 1] int64: last output tokens, -2 before the output


@dataclass
class Penalties:
    rows: torch.Tensor  # [r] int64
    token_ids: torch.Tensor  # [r, max_len] prompt + output tokens, padded with the first token
    is_output: torch.Tensor  # [r, max_len] bool: an output token (False in the padding)
    repetition: torch.Tensor  # [r] fp32, 1 = off
    frequency: torch.Tensor  # [r] fp32, 0 = off
    presence: torch.Tensor  # [r] fp32, 0 = off


@dataclass
class Filters:
    """min-p, top-k and top-p of the sampled (non-greedy) rows that use any of them."""

    rows: torch.Tensor  # [r] int64
    min_p: torch.Tensor  # [r] fp32, 0 = off
    top_k: torch.Tensor  # [r] int64 in [1, vocab), 0 = off
    top_p: torch.Tensor  # [r] fp32, 1 = off
    max_top_k: int  # host-side max of top_k, so that no step needs a device sync for it
    any_top_p: bool


@dataclass
class Allowed:
    rows: torch.Tensor  # [r] int64
    banned: torch.Tensor  # [r, vocab] bool: True outside the row's allowed_token_ids


@dataclass
class GrammarMask:
    """Structured outputs: the tokens each grammar-bound row may take next."""

    rows: torch.Tensor  # [r] int64
    bitmask: torch.Tensor  # [r, ceil(vocab / 32)] int32: bit b of word w allows token 32w + b


@dataclass
class LogprobsSpec:
    """Which rows want logprobs, from which stage, as logprobs or as logits."""

    num_logprobs: list[int]  # [n] top alternatives per row, -1 = no logprobs
    raw_rows: torch.Tensor | None  # [r] rows with a raw_* mode
    processed_rows: torch.Tensor | None  # [p] rows with a processed_* mode
    as_logprobs: torch.Tensor  # [n] bool: *_logprobs (else *_logits)

    @property
    def max_num(self) -> int:
        return max(self.num_logprobs)


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [n] fp32; greedy rows: is_greedy(temperature)
    all_greedy: bool
    all_random: bool
    needs_temperature: bool  # some sampled row has temperature != 1
    random_rows: torch.Tensor  # [m] int64 rows that sample (not greedy)
    seeded: torch.Tensor  # [n] bool
    seeds: torch.Tensor  # [n] int64
    output_positions: torch.Tensor  # [n] int64, index of the token being sampled
    filters: Filters | None = None
    allowed: Allowed | None = None
    bad_words: BadWords | None = None
    min_tokens: TokenRows | None = None  # ids to ban (stop ids + EOS) while below min_tokens
    logit_bias: TokenBias | None = None
    penalties: Penalties | None = None
    grammar: GrammarMask | None = None
    logprobs: LogprobsSpec | None = None

    @property
    def greedy_mask(self) -> torch.Tensor:  # [n] bool
        return is_greedy(self.temperature)

    @property
    def changes_logits(self) -> bool:
        """Whether any step writes into the logits (if not, raw logprobs need no copy)."""
        steps = (
            self.allowed,
            self.bad_words,
            self.min_tokens,
            self.logit_bias,
            self.penalties,
            self.grammar,
        )
        return not self.all_greedy or any(step is not None for step in steps)
