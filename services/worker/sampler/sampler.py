"""Greedy / temperature / min-p / top-k / top-p sampling with position-keyed seeds.

Randomness for a seeded request depends only on (seed, output position), never on what else
is in the batch or on generator state, so a request resumes identically after preemption or
on another worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.sampler.metadata import SamplingMetadata

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant to spread (seed, position) pairs


@dataclass
class SamplerResult:
    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    # With logprobs requested: [num_reqs, 1 + max_logprobs] ids / values, sampled token first.
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None  # [num_reqs] 1-based rank of the sampled token


class Sampler:
    def __init__(self) -> None:
        self._unseeded = torch.Generator()
        self._unseeded.seed()

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerResult:
        """logits: [num_reqs, vocab_size] -> one token per row."""
        raw_logprobs = None
        if meta.max_num_logprobs >= 0:
            raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if meta.all_greedy:
            sampled = greedy
        else:
            sampled = torch.where(meta.greedy_mask, greedy, self._sample(logits, meta))
        result = SamplerResult(sampled_token_ids=sampled)
        if raw_logprobs is not None:
            self._gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs, result)
        return result

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        temperature = torch.where(meta.greedy_mask, 1.0, meta.temperature)
        logits = logits / temperature.unsqueeze(1)
        if bool((meta.min_p > 0).any()):
            logits = apply_min_p(logits, meta.min_p)
        if bool((meta.top_k > 0).any()) or bool((meta.top_p < 1).any()):
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = logits.softmax(dim=-1)
        noise = self._exponential_noise(probs.shape, meta)
        return probs.div_(noise).argmax(dim=-1)  # exponential race == sampling from probs

    def _exponential_noise(self, shape: torch.Size, meta: SamplingMetadata) -> torch.Tensor:
        noise = torch.empty(shape).exponential_(generator=self._unseeded)
        seeds, positions = meta.seeds.tolist(), meta.output_positions.tolist()
        for row, (seed, pos) in enumerate(zip(seeds, positions, strict=True)):
            if seed >= 0:
                gen = torch.Generator().manual_seed(position_seed(seed, pos))
                noise[row].exponential_(generator=gen)
        return noise

    @staticmethod
    def _gather_logprobs(
        logprobs: torch.Tensor, sampled: torch.Tensor, k: int, result: SamplerResult
    ) -> None:
        sampled_lp = logprobs.gather(1, sampled.unsqueeze(1))  # [num_reqs, 1]
        top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], sampled[:0])
        result.logprob_token_ids = torch.cat(
            (sampled.unsqueeze(1), top_ids.view(len(sampled), -1)), 1
        )
        result.logprobs = torch.cat((sampled_lp, top_lp), dim=1)
        result.sampled_ranks = (logprobs > sampled_lp).sum(dim=-1) + 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed derived from (request seed, output position) alone."""
    return ((seed * _SEED_MIX) ^ (position * 0xBF58476D1CE4E5B9) ^ position) % (2**63 - 1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Keep the k most likely tokens (k=0: all), then the smallest set whose mass reaches p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [num_reqs]
    ranks = torch.arange(vocab).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
