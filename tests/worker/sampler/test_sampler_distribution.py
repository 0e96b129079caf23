"""Sampled tokens follow the target distribution (chi-square), with fixed seeds.

Each case samples one row of logits many times in one batch: seeded rows (seed, position) or
unseeded rows from a fixed-seed generator. The expected distribution is the reference
processing (test_sampler.py) in float64; tokens outside its support must never appear.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from services.worker.sampler import Sampler
from shared.sampling_params import SamplingParams
from tests.worker.sampler.test_sampler import Req, make_metadata, ref_filters

DRAWS = 20_000
LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.5, 0.0, -0.3, -0.8, -1.5, -2.5, -4.0])

CASES = {
    "temperature 1": dict(temperature=1.0),
    "temperature 0.5": dict(temperature=0.5),
    "temperature 2": dict(temperature=2.0),
    "top_k 3": dict(temperature=1.0, top_k=3),
    "top_p 0.7": dict(temperature=0.8, top_p=0.7),
    "min_p 0.2": dict(temperature=1.2, min_p=0.2),
    "all filters": dict(temperature=1.5, top_k=6, top_p=0.9, min_p=0.05),
}


def expected_probs(params: SamplingParams) -> torch.Tensor:
    logits, ambiguous = ref_filters(LOGITS.double(), params)
    assert not ambiguous
    return logits.softmax(0)


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    """Chi-square goodness of fit; bins expecting fewer than 5 draws are pooled."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a filtered token"
    expected = probs * len(tokens)
    big = expected >= 5
    small = support & ~big
    observed = torch.cat((counts[big], counts[small].sum().reshape(1)))
    wanted = torch.cat((expected[big], expected[small].sum().reshape(1)))
    if wanted[-1] < 5:  # pool the rare tail into the smallest big bin instead
        observed, wanted = observed[:-1], wanted[:-1]
        observed[-1] += counts[small].sum()
        wanted[-1] += expected[small].sum()
    p_value = chisquare(
        observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item()
    ).pvalue
    assert p_value > 1e-3, (counts.tolist(), expected.tolist(), p_value)


@pytest.mark.parametrize("name", list(CASES))
def test_seeded_sampling_matches_the_distribution(name):
    # Half the draws vary the seed at one position, half one seed over output positions.
    fields = CASES[name]
    half = DRAWS // 2
    reqs = [Req(SamplingParams(seed=i, **fields), [3], [4] * (i % 3)) for i in range(half)]
    reqs += [Req(SamplingParams(seed=12345, **fields), [3])] * half
    meta = make_metadata(reqs, len(LOGITS))
    meta.output_positions[half:] = torch.arange(half)
    tokens = Sampler(seed=0)(LOGITS.repeat(len(reqs), 1), meta).sampled_token_ids
    assert_follows(tokens, expected_probs(SamplingParams(**fields)))


@pytest.mark.parametrize("name", ["temperature 1", "all filters"])
def test_unseeded_sampling_matches_the_distribution(name):
    fields = CASES[name]
    reqs = [Req(SamplingParams(**fields), [3])] * DRAWS
    meta = make_metadata(reqs, len(LOGITS))
    tokens = Sampler(seed=2024)(LOGITS.repeat(DRAWS, 1), meta).sampled_token_ids
    assert_follows(tokens, expected_probs(SamplingParams(**fields)))


def test_large_vocabulary_blocks_match_the_distribution():
    """A vocabulary of several 1024-token blocks, with the mass on both sides of boundaries."""
    vocab = 3000
    hot = torch.tensor([0, 1023, 1024, 1025, 2047, 2048, 2999])
    logits = torch.full((vocab,), float("-inf"))
    logits[hot] = torch.tensor([0.5, 1.0, 0.0, -0.5, 0.8, 0.2, 1.1])
    reqs = [Req(SamplingParams(seed=i), [3], [5] * (i % 4)) for i in range(DRAWS)]
    tokens = Sampler()(logits.repeat(DRAWS, 1), make_metadata(reqs, vocab)).sampled_token_ids
    assert torch.isin(tokens, hot).all()
    assert_follows(torch.searchsorted(hot, tokens), logits[hot].double().softmax(0))
