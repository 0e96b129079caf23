"""The persistent batch's sampling columns: every column is set from SamplingParams and moves
with its row when `condense` fills a hole."""

from __future__ import annotations

import dataclasses

import numpy as np

from services.worker.input_batch import CachedRequestState, InputBatch
from services.worker.sampling_columns import SamplingColumns
from services.worker.token_tables import TokenMaskTable
from shared.sampling_params import SamplingParams

EVERYTHING = SamplingParams(
    temperature=0.7,
    top_p=0.8,
    top_k=5,
    min_p=0.1,
    seed=-3,
    logprobs=2,
    logprobs_mode="processed_logits",
    prompt_logprobs=1,
    min_tokens=4,
    repetition_penalty=1.5,
    frequency_penalty=0.5,
    presence_penalty=-0.3,
    stop_token_ids=[4, 5],
    allowed_token_ids=list(range(50)),
    logit_bias={3: 2.0, 9: -1.0},
    bad_words_token_ids=[[7, 8], [9]],
)


def row_of(column: object, row: int) -> list[np.ndarray]:
    """A column's entries for `row`: the array's, or every array of a token table."""
    arrays = [column] if isinstance(column, np.ndarray) else list(vars(column).values())
    return [arr[row].copy() for arr in arrays if isinstance(arr, np.ndarray)]


def test_condense_moves_every_sampling_column():
    batch = InputBatch(max_num_reqs=3, max_model_len=8, block_size=4)
    for i, params in enumerate([SamplingParams(), SamplingParams(), EVERYTHING]):
        batch.add_request(CachedRequestState(f"r{i}", [1, 2], params, [i], 0))
    names = [f.name for f in dataclasses.fields(SamplingColumns)]
    before = {name: row_of(getattr(batch.sampling, name), 2) for name in names}
    for name in names:  # EVERYTHING sets every column: the check below covers them all
        hole = row_of(getattr(batch.sampling, name), 0)
        assert any(not np.array_equal(a, b) for a, b in zip(before[name], hole, strict=True))
    batch.remove_request("r0")
    batch.condense()
    assert batch.req_ids[:2] == ["r2", "r1"] and batch.num_reqs == 2
    for name in names:
        after = row_of(getattr(batch.sampling, name), 0)
        assert all(np.array_equal(a, b) for a, b in zip(before[name], after, strict=True)), name


def test_greedy_rows_have_every_filter_off():
    batch = InputBatch(max_num_reqs=1, max_model_len=8, block_size=4)
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    batch.add_request(CachedRequestState("g", [1], greedy, [0], 0))
    cols = batch.sampling
    assert (cols.top_p[0], cols.top_k[0], cols.min_p[0]) == (1.0, 0, 0.0)


def test_non_members_of_a_token_mask_table():
    """The complement of each row's set: ids past the stored width, and a vocabulary shorter
    than that width."""
    table = TokenMaskTable(3)
    table.set(0, [0, 5, 9])
    table.set(1, [17])  # widens the bits: row 0 keeps its ids
    for vocab in (7, 40):
        got = table.non_members(np.array([1, 0]), vocab)
        want = np.ones((2, vocab), dtype=bool)
        want[0, [i for i in [17] if i < vocab]] = False
        want[1, [i for i in [0, 5, 9] if i < vocab]] = False
        assert got.shape == (2, vocab)
        assert np.array_equal(got, want)
