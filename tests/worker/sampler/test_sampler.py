"""The sampler against a plain per-request reference, step by step and end to end.

The reference (top of this file, also used by the other test_sampler_* modules) is
straightforward Python on one request at a time, in float64. Decisions within float rounding
of a boundary are reported as ambiguous and skipped instead of flaking.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.input_batch import CachedRequestState, InputBatch
from services.worker.sampler import Sampler, block_topk, topk_topp
from services.worker.sampler.chunking import logsumexp_with_max
from services.worker.sampler.logprobs import top_logprobs
from services.worker.sampler.metadata import SamplingMetadata
from services.worker.sampler.penalties import apply_penalties, output_counts
from services.worker.sampler.random import position_uniforms
from services.worker.sampler.sampler import apply_logit_processors
from services.worker.sampler.topk_topp import (
    Cutoffs,
    compute_cutoffs,
    mask_below,
    temperature_divisor,
)
from services.worker.sampling_metadata import build_sampling_metadata
from shared.sampling_params import LOGPROBS_MODES, SamplingParams

EOS = (1, 2)
_M64 = 2**64 - 1
NEG_INF = float("-inf")


@dataclass
class Req:
    params: SamplingParams
    prompt: list[int]
    output: list[int] = field(default_factory=list)


def make_batch(reqs: list[Req]) -> InputBatch:
    max_len = max(len(r.prompt) + len(r.output) for r in reqs) + 1
    batch = InputBatch(max_num_reqs=len(reqs), max_model_len=max_len, block_size=16)
    for i, r in enumerate(reqs):
        state = CachedRequestState(f"r{i}", list(r.prompt), r.params, [], 0, list(r.output))
        batch.add_request(state)
    return batch


def make_metadata(reqs: list[Req], vocab: int) -> SamplingMetadata:
    return build_sampling_metadata(make_batch(reqs), np.arange(len(reqs)), vocab, EOS)


# ---- stages -------------------------------------------------------------------------------


def ref_processors(x: torch.Tensor, req: Req) -> torch.Tensor:
    """allowed ids -> bad words -> min_tokens -> logit_bias -> penalties, on one row."""
    p, out = req.params, req.output
    x = x.double().clone()
    if p.allowed_token_ids is not None:
        banned = torch.ones_like(x, dtype=torch.bool)
        banned[p.allowed_token_ids] = False
        x[banned] = NEG_INF
    for word in p.bad_words_token_ids or []:
        prefix = word[:-1]
        if len(prefix) <= len(out) and out[len(out) - len(prefix) :] == prefix:
            x[word[-1]] = NEG_INF
    if len(out) < p.min_tokens:
        x[[*p.stop_token_ids, *EOS]] = NEG_INF
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    return ref_penalties(x, req)


def ref_penalties(x: torch.Tensor, req: Req) -> torch.Tensor:
    p = req.params
    for token in set(req.prompt) | set(req.output):
        r = p.repetition_penalty
        x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token, count in Counter(req.output).items():
        x[token] -= p.frequency_penalty * count + p.presence_penalty
    return x


def ref_filters(x: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, bool]:
    """temperature -> min_p -> top_k -> top_p; returns (logits, ambiguous)."""
    x = x.clone()
    if params.greedy:
        return x, False
    x = x / params.temperature
    ambiguous = False
    if params.min_p > 0:
        probs = x.softmax(0)
        threshold = params.min_p * probs.max()
        near = (probs - threshold).abs() <= 1e-6 * probs.max()
        ambiguous |= bool((near & (probs < probs.max())).any())
        x[probs < threshold] = NEG_INF
    k = params.top_k
    if 0 < k < len(x):
        x[x < x.sort(descending=True).values[k - 1]] = NEG_INF
    if params.top_p < 1:
        order = x.argsort()
        cum = x[order].softmax(0).cumsum(0)
        drop = cum <= 1 - params.top_p
        drop[-1] = False
        ambiguous |= bool(((cum - (1 - params.top_p)).abs() < 1e-5).any())
        x[order[drop]] = NEG_INF
    return x, ambiguous


def ref_inverse_cdf(x: torch.Tensor, u: float) -> tuple[int, bool]:
    """Token whose CDF interval holds u * total; ambiguous if u is close to a boundary."""
    cdf = x.softmax(0).cumsum(0)
    target = u * float(cdf[-1])
    token = int(
        torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype)).clamp(max=len(x) - 1)
    )
    lo = float(cdf[token - 1]) if token else 0.0
    return token, min(abs(float(cdf[token]) - target), abs(target - lo)) < 1e-5


# ---- position-keyed randomness ------------------------------------------------------------


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def ref_uniform(seed: int, position: int) -> float:
    h = _splitmix64((seed & _M64) ^ _splitmix64(position))
    return ((h >> 40) + 1) / 2**24


def ref_top_logprobs(values: torch.Tensor, token: int, k: int) -> tuple[list[int], float, int]:
    """(top-k ids, value of token, rank of token) of a [vocab] row of logprobs or logits."""
    top = values.topk(k).indices.tolist() if k else []
    return top, float(values[token]), int((values >= values[token]).sum())


# ---- strategies ---------------------------------------------------------------------------

VOCABS = st.sampled_from([3, 17, 64, 211, 1100, 2100])


@st.composite
def bad_words_st(draw, output: list[int], tok) -> list[list[int]]:
    words = []
    for _ in range(draw(st.integers(1, 3))):
        if output and draw(st.booleans()):  # prefix = the output's suffix: this one bites
            j = draw(st.integers(1, min(3, len(output))))
            words.append([*output[-j:], draw(tok)])
        else:
            words.append(draw(st.lists(tok, min_size=1, max_size=3)))
    return words


@st.composite
def req_st(draw, vocab: int) -> Req:
    tok = st.one_of(st.integers(0, min(vocab, 8) - 1), st.integers(0, vocab - 1))  # repeats
    prompt = draw(st.lists(tok, min_size=1, max_size=10))
    output = draw(st.lists(tok, max_size=8))
    kw: dict = {"temperature": draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]) | st.floats(0.05, 2))}
    if draw(st.booleans()):
        ks = st.sampled_from([-1, 0, 1, 2, vocab - 1, vocab, vocab + 5]) | st.integers(1, vocab)
        kw["top_k"] = draw(ks)
    if draw(st.booleans()):
        kw["top_p"] = draw(st.sampled_from([1.0, 0.5, 0.9]) | st.floats(0.01, 1.0))
    if draw(st.booleans()):
        kw["min_p"] = draw(st.sampled_from([0.0, 1.0, 0.1]) | st.floats(0.0, 1.0))
    if draw(st.booleans()):
        kw["repetition_penalty"] = draw(st.floats(0.5, 2.0))
        kw["frequency_penalty"] = draw(st.floats(-2.0, 2.0))
        kw["presence_penalty"] = draw(st.floats(-2.0, 2.0))
    if draw(st.booleans()):
        kw["logit_bias"] = draw(st.dictionaries(tok, st.floats(-100, 100), min_size=1, max_size=4))
    if draw(st.integers(0, 3)) == 0:
        kw["allowed_token_ids"] = draw(st.lists(tok, min_size=1, max_size=6))
    if draw(st.booleans()):
        kw["bad_words_token_ids"] = draw(bad_words_st(output, tok))
    if draw(st.booleans()):
        kw["min_tokens"] = draw(st.integers(0, 10))
        kw["stop_token_ids"] = draw(st.lists(tok, max_size=3))
    kw["seed"] = draw(st.none() | st.integers(-(2**63), 2**63 - 1))
    if draw(st.booleans()):
        kw["logprobs"] = draw(st.integers(0, 5))
        kw["logprobs_mode"] = draw(st.sampled_from(LOGPROBS_MODES))
    return Req(SamplingParams(**kw), prompt, output)


@st.composite
def batch_st(draw, max_reqs: int = 6) -> tuple[list[Req], torch.Tensor]:
    vocab = draw(VOCABS)
    reqs = draw(st.lists(req_st(vocab), min_size=1, max_size=max_reqs))
    scale = draw(st.sampled_from([0.1, 1.0, 4.0]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    return reqs, torch.randn(len(reqs), vocab, generator=g) * scale


# ---- helpers ------------------------------------------------------------------------------


def assert_same_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.double(), want.double()
    assert torch.equal(torch.isinf(got), torch.isinf(want)), (got, want)
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-4)


def processed(reqs: list[Req], logits: torch.Tensor) -> torch.Tensor:
    return torch.stack([ref_processors(logits[i], r) for i, r in enumerate(reqs)])


def apply_filters(x: torch.Tensor, meta: SamplingMetadata) -> None:
    """The sampler's temperature and filters, with every row masked in full (as its processed
    logprobs snapshot is; sampling itself skips the full masking for small kept sets)."""
    divisor = temperature_divisor(meta.temperature) if meta.needs_temperature else None
    cut = None if meta.filters is None else compute_cutoffs(x, meta.filters, divisor)
    if divisor is not None:
        x.div_(divisor)
    if cut is not None:
        mask_below(x, cut.threshold)


def near_tie_at_top(x: torch.Tensor) -> bool:
    finite = x[torch.isfinite(x)]
    top = finite.topk(min(2, len(finite))).values
    return len(top) == 2 and float(top[0] - top[1]) < 1e-4


def check_logprobs(result, j: int, req: Req, values: torch.Tensor, token: int) -> None:
    """values: the reference row at the requested stage, as logits (float64)."""
    p = req.params
    if p.logprobs_mode.endswith("logprobs"):
        values = values.log_softmax(0)
    k = min(p.logprobs, len(values))
    ids = result.logprob_token_ids[j, : k + 1].tolist()
    got = result.logprobs[j, : k + 1].double()
    assert ids[0] == token
    _, want_token, _ = ref_top_logprobs(values, token, k)
    torch.testing.assert_close(
        got[0], torch.tensor(want_token, dtype=torch.float64), rtol=1e-5, atol=1e-4
    )
    # top-k by value (ids may swap only between near-ties)
    torch.testing.assert_close(got[1:], values.topk(k).values, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[1:], values[ids[1:]], rtol=1e-5, atol=1e-4)
    rank = int(result.sampled_ranks[j])
    assert int((values > want_token + 1e-4).sum()) + 1 <= rank
    assert rank <= int((values >= want_token - 1e-4).sum())


# ---- each step against the reference ------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(batch_st())
def test_processors_and_penalties_match_reference(batch):
    reqs, logits = batch
    vocab = logits.shape[1]
    meta = make_metadata(reqs, vocab)
    x = logits.clone()
    apply_logit_processors(x, meta)
    if meta.penalties is not None:
        apply_penalties(x, meta.penalties)
    for i, req in enumerate(reqs):
        assert_same_logits(x[i], ref_processors(logits[i], req))


@settings(max_examples=60, deadline=None)
@given(batch_st())
def test_filters_match_reference(batch):
    reqs, logits = batch
    before = processed(reqs, logits).float()
    meta = make_metadata(reqs, logits.shape[1])
    x = before.clone()
    if not meta.all_greedy:
        apply_filters(x, meta)
    for i, req in enumerate(reqs):
        want, ambiguous = ref_filters(before[i].double(), req.params)
        if not ambiguous and torch.isfinite(want).any():
            assert_same_logits(x[i], want)


def assert_same_cutoffs(got: Cutoffs, want: Cutoffs) -> None:
    """The same thresholds, and the same small kept sets (values and ids) row for row."""
    assert torch.equal(got.threshold, want.threshold)
    assert (got.small is None) == (want.small is None)
    if got.small is not None and want.small is not None:
        assert torch.equal(got.small.rows, want.small.rows)
        kept, kept_want = got.small.values.isfinite(), want.small.values.isfinite()
        assert torch.equal(kept.sum(dim=1), kept_want.sum(dim=1))
        assert torch.equal(got.small.values[kept], want.small.values[kept_want])
        assert torch.equal(got.small.ids[kept], want.small.ids[kept_want])


@settings(max_examples=60, deadline=None)
@given(batch_st())
def test_cutoffs_before_temperature_equal_cutoffs_after(batch):
    """Cutoffs taken before the division by the temperature are bit for bit those of the
    divided logits: same thresholds, same small kept sets (their -inf padding may differ)."""
    reqs, logits = batch
    meta = make_metadata(reqs, logits.shape[1])
    if meta.filters is None:
        return
    x = processed(reqs, logits).float()
    divisor = temperature_divisor(meta.temperature)
    lazy = compute_cutoffs(x, meta.filters, divisor)
    eager = compute_cutoffs(x / divisor, meta.filters)
    assert_same_cutoffs(lazy, eager)


@settings(max_examples=60, deadline=None)
@given(batch_st())
def test_sampler_matches_reference_end_to_end(batch):
    reqs, logits = batch
    meta = make_metadata(reqs, logits.shape[1])
    result = Sampler(seed=0)(logits.clone(), meta)
    tokens = result.sampled_token_ids.tolist()
    for i, req in enumerate(reqs):
        mid = ref_processors(logits[i], req)
        final, ambiguous = ref_filters(mid, req.params)
        if ambiguous or not torch.isfinite(final).any():
            continue
        if req.params.greedy:
            if near_tie_at_top(final):
                continue
            assert tokens[i] == int(final.argmax())
        elif req.params.seed is not None:
            want, near_edge = ref_inverse_cdf(final, ref_uniform(req.params.seed, len(req.output)))
            if near_edge:
                continue
            assert tokens[i] == want
        else:
            assert torch.isfinite(final[tokens[i]])
        if req.params.logprobs is not None:
            stage = logits[i].double() if req.params.logprobs_mode.startswith("raw") else final
            check_logprobs(result, i, req, stage, tokens[i])


# ---- edge cases ---------------------------------------------------------------------------


def _sample(reqs: list[Req], logits: torch.Tensor, seed: int = 0) -> list[int]:
    meta = make_metadata(reqs, logits.shape[1])
    return Sampler(seed=seed)(logits.clone(), meta).sampled_token_ids.tolist()


def test_all_tokens_banned_but_one():
    vocab, keep = 300, 123
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(1)) * 3
    others = [[t] for t in range(vocab) if t != keep]
    variants = [
        SamplingParams(temperature=t, allowed_token_ids=[keep], top_k=k, top_p=p, min_p=m, seed=s)
        for t, k, p, m, s in [
            (0.0, -1, 1.0, 0.0, None),
            (1.0, 5, 0.3, 0.5, 3),
            (2.0, 1, 0.01, 1.0, None),
        ]
    ] + [SamplingParams(temperature=1.5, bad_words_token_ids=others, top_p=0.5, seed=9)]
    reqs = [Req(variants[i % len(variants)], [5, 6, 7], [8] * (i % 3)) for i in range(64)]
    assert _sample(reqs, logits) == [keep] * 64


def test_top_k_beyond_vocab_and_top_p_of_one_are_off():
    vocab = 50
    logits = torch.randn(40, vocab, generator=torch.Generator().manual_seed(2))

    def reqs(**kw):
        return [Req(SamplingParams(temperature=1.3, seed=i, **kw), [3]) for i in range(40)]

    plain = _sample(reqs(), logits)
    assert _sample(reqs(top_k=vocab + 7), logits) == plain
    assert _sample(reqs(top_k=vocab), logits) == plain
    assert _sample(reqs(top_p=1.0), logits) == plain
    assert make_metadata(reqs(top_k=vocab + 7, top_p=1.0), vocab).filters is None


def test_temperature_zero_next_to_two():
    vocab = 500
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3)) * 2
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, seed=11)] * 3
    reqs = [Req(p, [4, 5], [6] * i) for i, p in enumerate(params)]
    tokens = _sample(reqs, logits)
    for i in (0, 2, 4):
        assert tokens[i] == int(logits[i].argmax())
    for i in (1, 3, 5):
        want, _ = ref_inverse_cdf(logits[i].double() / 2.0, ref_uniform(11, i))
        assert tokens[i] == want


def test_top_p_widens_its_window_on_flat_distributions():
    vocab = 5000  # flat logits: the nucleus of p=0.99 holds thousands of tokens
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(4)) * 0.05
    reqs = [
        Req(SamplingParams(temperature=1.0, top_p=p, seed=1), [1])
        for p in (0.99, 0.5, 0.001, 0.9999)
    ]
    meta = make_metadata(reqs, vocab)
    x = logits.clone()
    apply_filters(x, meta)
    for i, req in enumerate(reqs):
        want, ambiguous = ref_filters(logits[i].double(), req.params)
        assert not ambiguous
        assert_same_logits(x[i], want)


def test_logprobs_clamped_to_a_tiny_vocabulary():
    logits = torch.randn(2, 3)
    reqs = [Req(SamplingParams(temperature=0.0, logprobs=20), [0])] * 2
    result = Sampler()(logits.clone(), make_metadata(reqs, 3))
    assert result.logprobs.shape == (2, 4)


def test_small_kept_sets_sample_like_the_full_row():
    """Rows keeping <= 64 tokens sample from their topk window; the same kept set given as a
    masked full row (no filter) must yield the same tokens for the same seeds."""
    vocab, n = 3000, 200
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(6)) * 2
    kept = row.topk(10).indices
    masked = torch.full_like(row, float("-inf"))
    masked[kept] = row[kept]
    filtered = [Req(SamplingParams(top_k=10, seed=i), [1], [2] * (i % 5)) for i in range(n)]
    plain = [Req(SamplingParams(seed=i), [1], [2] * (i % 5)) for i in range(n)]
    meta = make_metadata(filtered, vocab)
    cut = compute_cutoffs(row.repeat(n, 1), meta.filters)
    assert cut.small is not None and len(cut.small.rows) == n
    assert _sample(filtered, row.repeat(n, 1)) == _sample(plain, masked.repeat(n, 1))


@pytest.mark.parametrize("length", [1, 2, 7, 128])
def test_output_counts_match_a_counter(length):
    """Runs of equal ids across prompt and output, ids only in the prompt, rows of one id."""
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(0, 5, (30, length), generator=g)
    ids[:3] = 4  # one id throughout
    is_output = torch.rand(30, length, generator=g) < 0.5
    is_output[3] = False  # no output
    is_output[4] = True  # all output
    want = [
        [Counter(t for t, out in zip(row, outs, strict=True) if out)[t] for t in row]
        for row, outs in zip(ids.tolist(), is_output.tolist(), strict=True)
    ]
    assert output_counts(ids, is_output).tolist() == want


def _wide_only(x, filters, divisor, monkeypatch):
    """compute_cutoffs with the wide window for every row (the first window switched off)."""
    with monkeypatch.context() as m:
        m.setattr(topk_topp, "_FIRST", 10**9)
        return compute_cutoffs(x, filters, divisor)


@pytest.mark.parametrize("vocab", [10, 300, 49152, 49155])
def test_first_window_decides_like_the_wide_window(vocab, monkeypatch):
    """Rows served by the first window (min-p or top-k <= 16 drops its last value) next to rows
    that need the wide one (top-p alone, flat rows, top-k past it, ties across its end), greedy
    rows and a vocabulary smaller than either window: the same thresholds bit for bit, the
    same small kept sets."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(14, vocab, generator=g) * 4  # peaked: min-p keeps a few tokens
    x[1] *= 0.01  # flat: min-p keeps thousands
    x[2, : min(vocab, 40)] = 30.0  # 40 tied maxima: across both windows' ends
    x[3, : min(vocab, 17)] = 30.0 + torch.arange(min(vocab, 17)) / 64  # 17 kept by min-p
    x[4, -20:] = 25.0  # tied in the tail past the last block
    params = [
        dict(min_p=0.05, top_k=50, top_p=0.9),
        dict(min_p=0.05),
        dict(min_p=0.5, top_k=20),
        dict(min_p=0.1),
        dict(top_k=16),
        dict(top_p=0.99),  # top-p alone: the wide window, widened on flat rows
        dict(top_k=300, min_p=0.2),  # a k past the first window
        dict(top_k=3, top_p=0.5),
        dict(temperature=0.0),  # greedy: no filter
        dict(min_p=0.01, top_k=1000),
        dict(top_k=17),
        dict(min_p=1.0),
        dict(temperature=3.0, min_p=0.05),
        dict(temperature=0.3, top_p=0.999, top_k=70),
    ]
    reqs = [Req(SamplingParams(**{"temperature": 0.8, **p}), [1]) for p in params]
    meta = make_metadata(reqs, vocab)
    divisor = temperature_divisor(meta.temperature)
    got = compute_cutoffs(x.clone(), meta.filters, divisor)
    want = _wide_only(x.clone(), meta.filters, divisor, monkeypatch)
    assert_same_cutoffs(got, want)
    tokens = _sample(reqs, x)
    with monkeypatch.context() as m:
        m.setattr(topk_topp, "_FIRST", 10**9)
        assert _sample(reqs, x) == tokens


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("vocab", [300, 1000, 4096, 5000, 49155])
def test_block_topk_and_argmax_match_torch(vocab, strided):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(12, vocab + 3 * strided, generator=g)[:, :vocab]  # strided: rows padded
    x[1] = float("-inf")  # nothing finite
    x[2, 5:] = float("-inf")  # fewer finite values than k
    x[3] = 0.5  # all tied
    x[4, -1] = 100.0  # maximum in the tail
    x[5, :: vocab // 7] = 50.0  # tied maxima: the first one wins
    x[6, 128:192] = 10 + torch.arange(64) / 64  # the top 64 in one block, 8 sub-blocks
    x[7, ::3] = 7.0  # ties spread over every sub-block, past k
    x[8, -3:] = 60.0 + torch.arange(3)  # the top 3 past the last whole block and sub-block
    assert torch.equal(block_topk.argmax(x), x.argmax(dim=1))
    for k in (1, 5, 20, 65):
        values, ids = block_topk.topk(x, k)
        assert torch.equal(values, x.topk(k, dim=1).values)
        assert torch.equal(x.gather(1, ids), values)
        assert all(len(set(row)) == k for row in ids.tolist())


@pytest.mark.parametrize("vocab", [300, 5000, 49155])
def test_block_topk_of_some_rows_equals_block_topk_of_their_copy(vocab):
    """`rows` picks blocks straight from x: the values and ids of x[rows]'s own topk."""
    x = torch.randn(12, vocab, generator=torch.Generator().manual_seed(vocab))
    x[3, -1] = 100.0  # maximum in the tail
    rows = torch.tensor([0, 3, 4, 11])
    maxima = block_topk.block_maxima(x)[rows]
    for k in (1, 17, 65):
        want = block_topk.topk(x[rows], k)
        for got in (block_topk.topk(x, k, rows=rows), block_topk.topk(x, k, maxima, rows)):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("vocab", [300, 5000, 49152, 49155])
def test_top_logprobs_match_a_full_pass(vocab):
    """Top values, their ids and the chosen token's rank, against a full pass over each row:
    ids as torch.topk gives them where the top values and the next one are distinct, and
    where some tie, the ids of the 64-wide block_topk window (the tie order top logprobs
    always had)."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(40, vocab, generator=g) * 3
    x[:10] = (x[:10] * 2).round()  # ties in the top values
    x[10, :] = 0.5  # all tied
    x[11, 7] = x[11].max() + 1  # a tie below a unique maximum
    x[11, 9] = x[11, 7]
    token_ids = torch.randint(0, vocab, (40,), generator=g)
    token_ids[20:30] = x[20:30].topk(20, dim=1).indices[:, 19]  # rank 20: past 16 blocks' floor?
    token_ids[30:] = x[30:].argmax(dim=1)
    as_logprobs = torch.arange(40) % 2 == 0
    for num_top in (0, 1, 5, 20):
        got = top_logprobs(x.clone(), token_ids, num_top, as_logprobs)
        chosen = x.gather(1, token_ids.unsqueeze(1))
        lse = torch.where(as_logprobs.unsqueeze(1), x.logsumexp(dim=1, keepdim=True), 0.0)
        top = x.topk(num_top, dim=1)
        assert torch.equal(got.ranks, (x >= chosen).sum(dim=1))
        assert torch.equal(got.values, torch.cat((chosen, top.values), dim=1) - lse)
        assert torch.equal(got.token_ids[:, 0], token_ids)
        head = x.topk(num_top + 1, dim=1).values  # the top num_top and the next value
        distinct = (head[:, 1:] < head[:, :-1]).all(dim=1)
        window_ids = block_topk.topk(x, min(vocab, max(num_top, 64)))[1][:, :num_top]
        want = torch.where(distinct.unsqueeze(1), top.indices, window_ids)
        assert torch.equal(got.token_ids[:, 1:], want)


@pytest.mark.parametrize("vocab", [3, 300, 49155])
def test_logsumexp_with_max_is_torch_logsumexp_bit_for_bit(vocab):
    """Chunks of rows through one buffer (a short last chunk too), rows with -inf and +inf,
    and the input left unchanged."""
    x = torch.randn(45, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    x[3] = NEG_INF  # nothing finite
    x[4, 1:] = NEG_INF
    x[5, 0] = float("inf")
    before = x.clone()
    got = logsumexp_with_max(x, x.amax(dim=1, keepdim=True))
    assert torch.equal(got, x.logsumexp(dim=1, keepdim=True))
    assert torch.equal(x, before)


# ---- seeds --------------------------------------------------------------------------------


def test_position_uniforms_match_the_reference_hash():
    seeds = [0, 1, -1, 42, 2**63 - 1, -(2**63), 123456789012345]
    positions = [0, 1, 7, 1000, 2**31, 5, 99]
    got = position_uniforms(torch.tensor(seeds), torch.tensor(positions)).tolist()
    assert got == [ref_uniform(s, p) for s, p in zip(seeds, positions, strict=True)]


def test_seeded_rows_ignore_the_rest_of_the_batch():
    vocab = 1500
    g = torch.Generator().manual_seed(5)
    row = torch.randn(vocab, generator=g)
    alone_params = SamplingParams(temperature=0.9, top_k=200, top_p=0.95, seed=77)
    target = Req(alone_params, [1, 2, 3], [4, 5])
    alone = _sample([target], row.unsqueeze(0), seed=1)[0]
    others = [
        Req(SamplingParams(temperature=t, seed=s), [9] * n)
        for t, s, n in [(0.0, None, 3), (1.7, None, 5), (0.3, 5, 2), (1.0, 77, 1)]
    ]
    for pos in range(len(others) + 1):
        reqs = [*others[:pos], target, *others[pos:]]
        logits = torch.randn(len(reqs), vocab, generator=g)
        logits[pos] = row
        assert _sample(reqs, logits, seed=pos + 100)[pos] == alone


def test_seeds_vary_with_position_and_unseeded_rows_vary():
    vocab = 100
    logits = torch.zeros(200, vocab)  # uniform distribution
    seeded = [Req(SamplingParams(seed=3), [1], [0] * i) for i in range(200)]
    assert len(set(_sample(seeded, logits))) > 60
    unseeded = [Req(SamplingParams(), [1])] * 200
    assert len(set(_sample(unseeded, logits))) > 60
    assert _sample(unseeded, logits, seed=1) != _sample(unseeded, logits, seed=2)


# ---- persistent batch ---------------------------------------------------------------------


def test_condense_moves_every_sampling_parameter():
    vocab = 211
    full = [
        SamplingParams(temperature=0.7, top_k=5, seed=1, logit_bias={3: 2.0}, logprobs=2),
        SamplingParams(
            temperature=1.2,
            top_p=0.8,
            min_p=0.1,
            repetition_penalty=1.5,
            seed=2,
            bad_words_token_ids=[[7, 8], [9]],
            allowed_token_ids=list(range(50)),
        ),
        SamplingParams(
            temperature=0.0,
            min_tokens=5,
            stop_token_ids=[4, 5],
            logprobs=1,
            logprobs_mode="processed_logprobs",
        ),
        SamplingParams(
            temperature=1.0,
            frequency_penalty=0.5,
            presence_penalty=-0.3,
            seed=4,
            bad_words_token_ids=[[1, 2, 3, 4]],
            logit_bias={10: -5.0, 11: 5.0},
            logprobs=3,
            logprobs_mode="processed_logits",
        ),
    ]
    reqs = [Req(p, [i + 3, 7, 8], [7] * i) for i, p in enumerate(full)]
    batch = make_batch(reqs)
    batch.remove_request("r0")
    batch.remove_request("r2")
    batch.condense()
    assert batch.req_ids[:2] == ["r3", "r1"]
    moved = build_sampling_metadata(batch, np.arange(2), vocab, EOS)
    fresh = make_metadata([reqs[3], reqs[1]], vocab)
    logits = torch.randn(2, vocab)
    got = Sampler(seed=0)(logits.clone(), moved)
    want = Sampler(seed=0)(logits.clone(), fresh)
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    assert torch.equal(got.logprobs, want.logprobs)
    for name in ("temperature", "seeds", "output_positions", "seeded"):
        assert torch.equal(getattr(moved, name), getattr(fresh, name))


def test_all_features_off_means_no_work():
    meta = make_metadata([Req(SamplingParams(temperature=0.0), [1, 2])] * 3, 100)
    assert meta.all_greedy and not meta.needs_temperature
    optional = (
        "filters",
        "allowed",
        "bad_words",
        "min_tokens",
        "logit_bias",
        "penalties",
        "logprobs",
    )
    assert all(getattr(meta, name) is None for name in optional)
