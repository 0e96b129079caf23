"""Structured outputs in the worker: an llguidance matcher per structured request of the
persistent batch (torch-free; the step's bitmask is services/worker/grammar_bitmask.py).

A matcher is built when its request enters the batch (new, resumed after preemption, or moved
here from another worker) by replaying the request's output tokens, and advanced with each
token the runner appends. A matcher that sees a token its grammar refuses (it cannot happen
with its mask applied) turns to an error state whose mask allows only EOS.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from llguidance import LLMatcher, LLTokenizer

from shared.structured_outputs import StructuredOutputsParams, grammar_of

log = logging.getLogger("skiff.worker")


class GrammarCompiler:
    """Matchers for one model's tokenizer (`tokenizer.json` of the model directory, loaded at
    the first structured request: ~0.2 s for a 49k vocabulary)."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]):
        self.tokenizer_path = Path(model_dir) / "tokenizer.json"
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: LLTokenizer | None = None

    @property
    def tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            if not self.tokenizer_path.is_file():
                raise RuntimeError(f"structured outputs need {self.tokenizer_path}")
            self._tokenizer = LLTokenizer(
                str(self.tokenizer_path), n_vocab=self.vocab_size, eos_token=self.eos_token_ids
            )
        return self._tokenizer

    def matcher(self, params: StructuredOutputsParams, output_token_ids: list[int]) -> LLMatcher:
        """A matcher for `params` that has consumed `output_token_ids` (the tokens so far)."""
        matcher = LLMatcher(self.tokenizer, grammar_of(params), log_level=0)
        if output_token_ids and not matcher.consume_tokens(output_token_ids):
            log.warning("structured output replay refused: %s", matcher.get_error())
        return matcher


def advance(matcher: LLMatcher, token_id: int) -> None:
    """Feed one sampled token to a matcher."""
    if not matcher.is_stopped() and not matcher.consume_token(token_id):
        log.warning("structured output token %d refused: %s", token_id, matcher.get_error())
