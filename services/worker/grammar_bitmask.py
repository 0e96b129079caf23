"""The step's structured-output masks: one preallocated [max_rows, words] int32 tensor on the
host (pinned for CUDA), filled for the structured rows by llguidance's executor (its own
threads, without the GIL) and copied to the device at once."""

from __future__ import annotations

import torch
from llguidance import LLExecutor, LLMatcher


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row (bit b of word w: token 32 * w + b)."""
    return (vocab_size + 31) // 32


class GrammarBitmask:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.device = device
        pin = device.type == "cuda"
        words = bitmask_words(vocab_size)
        self.host = torch.full((max_rows, words), -1, dtype=torch.int32, pin_memory=pin)
        self.executor = LLExecutor()

    def fill(self, matchers: list[LLMatcher]) -> torch.Tensor:
        """Row i: the tokens `matchers[i]` allows next ([r, words] on the device; from pinned
        memory the copy is asynchronous, done before the step's sampled tokens reach the
        host, so the next fill never overwrites a copy in flight)."""
        host = self.host[: len(matchers)]
        row_bytes = host.shape[1] * host.element_size()
        pairs = list(zip(matchers, range(len(matchers)), strict=True))
        self.executor.unsafe_compute_mask_ptr(pairs, host.data_ptr(), row_bytes, len(matchers))
        return host.to(self.device, non_blocking=True)
