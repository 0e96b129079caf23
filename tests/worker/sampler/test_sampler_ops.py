"""The sampler's C++ ops (kernels/csrc/sampler_ops.cpp) against torch: `logit_stats`, with each
instruction set this CPU has: block maxima and the whitelist-masked copy exactly, the
logsumexp as close to float64 as torch's own; `row_topk`: torch.topk's values, ties in index
order; `row_argmax`: torch.argmax's ids. Then the sampler with the ops against the sampler
on torch's path: the same tokens, logprob ids and ranks, logprobs within LOGPROB_TOL (the two
logsumexps may round apart by an ulp or two)."""

from __future__ import annotations

from unittest.mock import patch

import msgspec
import pytest
import torch
from hypothesis import given, settings

from bench.sampler_bench import params_for
from kernels import cpu_ops
from services.worker.sampler import Sampler, SamplerOutput
from services.worker.sampler import sampler as sampler_module
from services.worker.sampler.block_topk import argmax, block_maxima, row_topk
from services.worker.sampler.logit_stats import fused, logit_stats
from services.worker.sampler.logprobs import top_logprobs
from shared.sampling_params import LOGPROBS_MODES, SamplingParams
from tests.cpu_isa import running_isa
from tests.worker.sampler.test_sampler import Req, batch_st, make_metadata

pytestmark = pytest.mark.unit

NEG_INF, INF = float("-inf"), float("inf")
# SIMD widths 8 and 16, blocks of 64: tails of every kind, no whole block, SmolLM2's 49152.
VOCABS = [1, 3, 15, 17, 63, 64, 65, 100, 4099, 49152, 49155]
LOGPROB_TOL = {"rtol": 1e-6, "atol": 4e-6}  # 4e-6: two fp32 ulps of a logsumexp in [16, 32)


@pytest.fixture(params=cpu_ops.ISAS)
def isa(request):
    """Runs the op with each instruction set's kernels that this CPU can run."""
    with running_isa(request.param) as name:
        yield name


def edge_rows(vocab: int, strided: bool = False) -> torch.Tensor:
    """[12, vocab] fp32 logits: random rows and edge rows; strided: rows further apart than
    vocab (a column slice of a wider tensor)."""
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(12, vocab + 5 * strided, generator=g) * 4)[:, :vocab]
    x[1] = NEG_INF  # nothing finite
    x[2] = NEG_INF
    x[2, vocab // 2] = 3.0  # one finite value
    x[3, -1] = INF  # +inf in the tail (if any)
    x[4, 0] = INF
    x[5] *= 1e30  # large magnitudes, NaN-free: every other e^(x - max) underflows
    x[6] = x[6] * 1e4 - 1e6
    x[7] = 0.5  # all tied
    x[8, ::7] = NEG_INF
    x[9] -= 200.0  # e^x underflows without the shift
    x[10] = x[10] / 100  # flat: every term counts
    return x


def banned_mask(vocab: int) -> torch.Tensor:
    """[12, vocab] bool: random whitelists, one row with all banned, one with none, one with
    all banned but its last token."""
    banned = torch.rand(12, vocab, generator=torch.Generator().manual_seed(-vocab)) < 0.3
    banned[0] = True
    banned[1] = False
    banned[2] = True
    banned[2, -1] = False
    return banned


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("vocab", VOCABS)
def test_block_maxima_and_masked_copy_are_torchs(isa, vocab, strided):
    """out's rows aligned for streaming stores (offset 0, vocab a multiple of 16) or not; a
    mask with strided rows."""
    x = edge_rows(vocab, strided)
    banned = banned_mask(vocab)
    for offset in (0, 1):
        out = torch.full((12 * vocab + offset,), 7.0)[offset:].view(12, vocab)
        stats = logit_stats(x, banned, out)
        assert torch.equal(stats.block_max, block_maxima(x))
        assert torch.equal(out, torch.where(banned, NEG_INF, x))
        assert torch.equal(logit_stats(x, None, out).block_max, block_maxima(x))
        assert torch.equal(out, x)  # no mask: a plain copy
    assert torch.equal(logit_stats(x).block_max, block_maxima(x))
    wide_mask = torch.cat((banned, banned[:, :3]), dim=1)[:, :vocab]  # strided mask rows
    logit_stats(x, wide_mask, out)
    assert torch.equal(out, torch.where(banned, NEG_INF, x))


@pytest.mark.parametrize("vocab", VOCABS)
def test_logsumexp_is_as_close_to_float64_as_torchs(isa, vocab):
    """Within 2e-7 relative (and 1e-6 absolute near 0) of the float64 logsumexp, the bound
    torch's fp32 logsumexp meets too; infinite rows as torch has them."""
    x = edge_rows(vocab)
    got = logit_stats(x).lse  # [12, 1]
    want = x.double().logsumexp(dim=1, keepdim=True)
    torch_lse = x.logsumexp(dim=1, keepdim=True)
    assert torch.equal(torch.isinf(got), torch.isinf(torch_lse))
    assert torch.equal(got[torch.isinf(got)], torch_lse[torch.isinf(got)])
    finite = torch.isfinite(want)
    for lse in (got, torch_lse):
        torch.testing.assert_close(lse.double()[finite], want[finite], rtol=2e-7, atol=1e-6)


@pytest.mark.parametrize("vocab", [17, 4099])
def test_nan_propagates_as_in_torch(isa, vocab):
    x = edge_rows(vocab)
    x[0, 3] = float("nan")
    x[3, -1] = float("nan")
    stats = logit_stats(x)
    torch.testing.assert_close(stats.block_max, block_maxima(x), equal_nan=True)
    assert torch.equal(stats.lse.isnan(), x.logsumexp(dim=1, keepdim=True).isnan())


def test_refuses_what_it_does_not_cover(isa):
    x = torch.randn(4, 100)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        logit_stats(x.t())
    with pytest.raises(RuntimeError, match="banned needs out"):
        logit_stats(x, torch.zeros(4, 100, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="out must be"):
        logit_stats(x, None, torch.empty(4, 99))
    with pytest.raises(RuntimeError, match="k must be"):
        row_topk(x, 101)
    with pytest.raises(RuntimeError, match="row_argmax: x must be fp32"):
        torch.ops.skiff_cpu.row_argmax(x.double())
    assert not fused(x.double()) and not fused(x.t())


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("vocab", VOCABS)
def test_row_argmax_is_torchs(isa, vocab, strided):
    """The first index of each row's maximum, as torch.argmax: ties (the first wins), +-inf,
    all -inf, NaN (the first NaN wins), a maximum in the tail past the last whole block."""
    x = edge_rows(vocab, strided)
    x[11, -1] = x[11].max() + 1  # the maximum in the last value (the tail, if any)
    nan = x.clone()
    nan[0, vocab // 3] = float("nan")
    nan[3, ::5] = float("nan")
    for logits in (x, nan):
        assert fused(logits)
        assert torch.equal(argmax(logits), logits.argmax(dim=1))


def test_row_argmax_at_the_biggest_batch_is_torchs(isa):
    """257 rows of the model's vocabulary (past a batch of 256, split over the pool's threads),
    many with ties: torch.argmax's ids."""
    x = (torch.randn(257, 49152, generator=torch.Generator().manual_seed(257)) * 2).round()
    assert torch.equal(argmax(x), x.argmax(dim=1))


@pytest.mark.parametrize("n", [1, 2, 17, 768, 1088, 4163])
def test_row_topk_is_a_stable_descending_sort_cut_at_k(n):
    """torch.topk's values; ids as a stable descending sort has them (ties by index, NaN
    first); strided rows, k from 0 to n."""
    assert cpu_ops.load()
    g = torch.Generator().manual_seed(n)
    x = torch.randn(9, n + 3, generator=g)[:, :n]
    x[1] = NEG_INF
    x[2] = (x[2] * 2).round()  # many ties
    x[3] = torch.arange(n, dtype=torch.float32)  # ascending: every value displaces one
    x[4, n // 2] = float("nan")
    x[5, ::3] = float("nan")
    x[6, -1] = INF
    x[7] = 0.25
    for k in sorted({0, 1, min(n, 5), min(n, 17), min(n, 65), n}):
        values, ids = row_topk(x, k)
        want = x.sort(dim=1, descending=True, stable=True)
        torch.testing.assert_close(values, x.topk(k, dim=1).values, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(ids, want.indices[:, :k])


@pytest.mark.parametrize("vocab", [300, 5000, 49155])
def test_top_logprobs_from_the_stats_match_torchs(isa, vocab):
    """Given the op's stats, top_logprobs picks the same ids and ranks; close values."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(40, vocab, generator=g) * 3
    x[:10] = (x[:10] * 2).round()  # ties in the top values
    x[10, :] = 0.5
    token_ids = torch.randint(0, vocab, (40,), generator=g)
    token_ids[20:30] = x[20:30].topk(20, dim=1).indices[:, 19]
    as_logprobs = torch.arange(40) % 2 == 0
    for num_top in (0, 1, 5, 20):
        want = top_logprobs(x, token_ids, num_top, as_logprobs)
        got = top_logprobs(x, token_ids, num_top, as_logprobs, logit_stats(x))
        assert torch.equal(got.token_ids, want.token_ids)
        assert torch.equal(got.ranks, want.ranks)
        torch.testing.assert_close(got.values, want.values, **LOGPROB_TOL)


def assert_same_output(got: SamplerOutput, want: SamplerOutput) -> None:
    """Equal tokens, ranks and logprob ids, but for the ids of -inf logprobs: tied values, which
    row_topk takes in id order and torch.topk in an order of its own (random logits have no
    finite ties). Logprobs of a row with nothing finite are NaN on both paths."""
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    if want.logprobs is None:
        assert got.logprobs is None
        return
    assert got.logprobs is not None and got.logprob_token_ids is not None
    finite = torch.isfinite(want.logprobs)
    assert torch.equal(got.logprob_token_ids[finite], want.logprob_token_ids[finite])
    assert torch.equal(got.sampled_ranks, want.sampled_ranks)
    torch.testing.assert_close(got.logprobs, want.logprobs, equal_nan=True, **LOGPROB_TOL)


def on_both_paths(reqs: list[Req], logits: torch.Tensor) -> tuple[SamplerOutput, SamplerOutput]:
    """The sampler's output with the C++ ops, and with torch's path."""
    meta = make_metadata(reqs, logits.shape[1])
    assert cpu_ops.load()
    fused_out = Sampler(seed=0)(logits.clone(), meta)
    cpu_ops.use(False)
    try:
        torch_out = Sampler(seed=0)(logits.clone(), meta)
    finally:
        cpu_ops.use(True)
    return fused_out, torch_out


@settings(max_examples=60, deadline=None)
@given(batch_st())
def test_sampler_with_the_op_matches_torchs_path(batch):
    assert_same_output(*on_both_paths(*batch))


def all_on(i: int, vocab: int, mode: str) -> Req:
    """Every feature on (bench/sampler_bench.py's batch), logprobs of `mode`."""
    g = torch.Generator().manual_seed(i)
    history = torch.randint(0, vocab, (24,), generator=g).tolist()
    params = msgspec.structs.replace(params_for("on", i, vocab), logprobs_mode=mode)
    return Req(params, history[:12], history[12:])


@pytest.mark.parametrize("modes", [["raw_logprobs"], ["raw_logits"], LOGPROBS_MODES])
@pytest.mark.parametrize("vocab", [5000, 49155])
def test_all_features_on_match_torchs_path(vocab, modes):
    """Every row raw: the whitelist's copy takes the raw stats on the way; mixed modes: the
    stats of the raw and the processed rows on their own."""
    reqs = [all_on(i, vocab, modes[i % len(modes)]) for i in range(12)]
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    calls = []

    def spy(x, banned=None, out=None):
        calls.append(out is not None)
        return logit_stats(x, banned, out)

    with patch.object(sampler_module, "logit_stats", spy):
        assert_same_output(*on_both_paths(reqs, logits))
    assert calls == ([True] if len(modes) == 1 else [False, False])


def test_greedy_raw_logprobs_match_torchs_path():
    """No step changes the logits: raw logprobs read them as they are, stats from the op."""
    params = SamplingParams(temperature=0.0, logprobs=3, logprobs_mode="raw_logprobs")
    logits = torch.randn(5, 4099, generator=torch.Generator().manual_seed(5))
    assert_same_output(*on_both_paths([Req(params, [1, 2])] * 5, logits))
