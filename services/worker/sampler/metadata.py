"""Per-step sampling parameters of the rows being sampled, as batch tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_EPS = 1e-5


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [num_reqs] fp32, 0 = greedy
    top_k: torch.Tensor  # [num_reqs] int64, 0 = off
    top_p: torch.Tensor  # [num_reqs] fp32, 1 = off
    min_p: torch.Tensor  # [num_reqs] fp32, 0 = off
    seeds: torch.Tensor  # [num_reqs] int64, -1 = unseeded
    output_positions: torch.Tensor  # [num_reqs] int64, index of the token being sampled
    num_logprobs: list[int]  # per request, -1 = none requested

    @property
    def greedy_mask(self) -> torch.Tensor:
        return self.temperature < _EPS

    @property
    def all_greedy(self) -> bool:
        return bool(self.greedy_mask.all())

    @property
    def max_num_logprobs(self) -> int:
        return max(self.num_logprobs, default=-1)
