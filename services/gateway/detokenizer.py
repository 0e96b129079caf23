"""Incremental detokenization: the text each new token adds, never half a UTF-8 character."""

from __future__ import annotations

from shared.tokenizer import Tokenizer

_PREFIX_TOKENS = 6  # prompt tokens that give the first output token its context (spaces)


class IncrementalDetokenizer:
    """Wraps `tokenizers.decoders.DecodeStream`; bytes of a split character wait for the rest."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        prefix = prompt_ids[-_PREFIX_TOKENS:]
        if prefix and tokenizer.decode(prefix, skip_special_tokens=False).endswith("\ufffd"):
            prefix = []  # the prompt ends inside a character: its bytes are not ours to finish
        self._backend = tokenizer.backend
        self._stream = tokenizer.decode_stream(prefix, skip_special_tokens)

    def step(self, token_id: int) -> str:
        """The text this token completes (empty while a character is still partial)."""
        return self._stream.step(self._backend, token_id) or ""
