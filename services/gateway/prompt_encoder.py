"""Tokenizing client text without letting one request hurt the others.

Tokenizing costs about 70 bytes of memory per character (the Rust tokenizer's alignments and
encoding) and holds the CPU for ~0.4 µs per character, so a text is bounded *before* it is
tokenized: a token stands for at most `max_token_chars` characters (the longest token of the
vocabulary, in UTF-8 bytes, which is at least its length in characters), so a text longer than
`max_model_len * max_token_chars` characters has more tokens than the context holds and is
rejected at once. This is exact for tokenizers without a normalizer that removes text (byte-level
BPE such as GPT-2's, Llama 3's, SmolLM's). Texts longer than `SMALL_INPUT` are tokenized in a
thread, at most `concurrency` at once, through `encode_batch_fast`, which releases the GIL (the
plain `encode` does not, and would stall the event loop for as long as it runs).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from services.gateway.errors import APIError
from shared.tokenizer import Tokenizer

# Texts (in characters) and token lists this short are cheap at any context length: they are
# processed on the event loop without a bound, the context length decides afterwards.
SMALL_INPUT = 8192


@functools.cache
def longest_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters one token of the vocabulary can stand for (its UTF-8 bytes)."""
    return max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size))


class PromptEncoder:
    """Length bounds for client text, and tokenization off the event loop with a cap."""

    def __init__(
        self, tokenizer: Tokenizer, max_model_len: Callable[[], int], concurrency: int
    ) -> None:
        """`max_model_len()` is the context length (raising `APIError(503)` when unknown)."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_token_chars = longest_token_chars(tokenizer)
        self._slots = asyncio.Semaphore(concurrency)

    def max_chars(self) -> int:
        """The most characters a text can have and still fit the context in tokens."""
        return self.max_model_len() * self.max_token_chars

    def check_chars(self, num_chars: int, param: str, what: str = "prompt") -> None:
        """Reject text that cannot fit the context, whatever its tokens (400)."""
        if num_chars <= SMALL_INPUT:
            return  # cheap to tokenize; the token count decides
        limit = self.max_chars()
        if num_chars > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len()} tokens. "
                f"However, the {what} is {num_chars} characters long, more than {limit} "
                f"({self.max_token_chars} per token at most). "
                f"Please reduce the length of the {what}.",
                param,
            )

    async def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids of `text`, after `check_chars`."""
        self.check_chars(len(text), param)
        if len(text) <= SMALL_INPUT:
            return self.tokenizer.encode(text, add_special_tokens)
        async with self._slots:
            return await asyncio.to_thread(self._encode, text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        encoding = self.tokenizer.backend.encode_batch_fast(
            [text], add_special_tokens=add_special_tokens
        )[0]
        return list(encoding.ids)
