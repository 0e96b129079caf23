"""Prompts of chosen token lengths, cut from a small built-in corpus (tests and benchmarks)."""

from __future__ import annotations

import random
from typing import Protocol

CORPUS = """\
The river town woke slowly. Fishermen carried nets down to the water while the baker pulled
the first loaves from a brick oven that had burned all night. Children ran between the stalls
of the market, and an old man sat on the steps of the church, counting the boats as they left.
In the spring the water rose high enough to reach the lowest houses, and every family kept a
small boat tied to the back door, just in case.

A hash table stores keys and values in an array of buckets. To insert a key, the table computes
a hash of the key, reduces it modulo the number of buckets, and places the pair in that bucket.
When two keys land in the same bucket, the table resolves the collision either by chaining the
entries in a list or by probing for the next free slot. Good hash functions spread keys evenly,
which keeps the average lookup time constant even as the table grows.

def merge_sort(items):
    if len(items) <= 1:
        return items
    middle = len(items) // 2
    left = merge_sort(items[:middle])
    right = merge_sort(items[middle:])
    merged = []
    while left and right:
        merged.append(left.pop(0) if left[0] <= right[0] else right.pop(0))
    return merged + left + right

Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant cells,
chlorophyll absorbs light, which drives the splitting of water into oxygen, protons and
electrons. The electrons pass along a transport chain that pumps protons across a membrane, and
the resulting gradient powers the synthesis of ATP. In the Calvin cycle, the plant then uses ATP
and NADPH to fix carbon dioxide into sugars that feed the whole organism.

Dear team, thank you all for the effort you put into the release last week. We shipped on time,
the error rate stayed flat, and the customers who tried the new search told us it was faster.
Next quarter we will focus on reliability: fewer pages at night, clearer dashboards, and a
runbook for every alert. Please send me your ideas before Friday.

The history of the bicycle begins in the early nineteenth century with the running machine, a
wooden frame with two wheels that the rider pushed along with his feet. Pedals attached to the
front wheel came decades later, followed by the high-wheeler, whose huge front wheel made it fast
but dangerous. The safety bicycle, with a chain drive and two wheels of equal size, finally made
cycling popular with everyone, and its basic shape has hardly changed since.
"""

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prime number is.",
    "List three uses of a paperclip.",
    "How do I reverse a string in Python?",
    "Why is the sky blue?",
    "Give me a synonym for happy.",
    "What is 12 times 7?",
]


class TokenEncoder(Protocol):
    """What the workload needs of a tokenizer (ours or transformers')."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def token_prompts(tokenizer: TokenEncoder, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of exactly the given lengths, each from a different corpus offset."""
    corpus = tokenizer.encode(CORPUS * 4, add_special_tokens=False)
    rng = random.Random(seed)
    prompts = []
    for n in lengths:
        if n > len(corpus):
            raise ValueError(f"corpus has only {len(corpus)} tokens")
        start = rng.randrange(0, len(corpus) - n + 1)
        prompts.append(corpus[start : start + n])
    return prompts


def reference_workload(
    tokenizer: TokenEncoder, num_requests: int = 32, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """The reference workload: prompts of 16-256 tokens, outputs of 16-128 tokens."""
    rng = random.Random(seed)
    lengths = [rng.randint(16, 256) for _ in range(num_requests)]
    outputs = [rng.randint(16, 128) for _ in range(num_requests)]
    return token_prompts(tokenizer, lengths, seed), outputs
