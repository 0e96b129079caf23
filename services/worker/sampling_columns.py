"""The persistent batch's sampling parameters: one array (or token table) per parameter, one
row per request, gathered by row each step (services/worker/sampling_metadata.py).

Each column is declared once, as a field with the storage of an unused row and how a request's
`SamplingParams` fills its row; allocation, setting and row moves follow from the fields.
Greedy rows get every filter off (as vLLM does), so they never cost a pass.
"""

# ruff: noqa: RUF009  (`_array`/`_table` return a dataclasses.field without a default)

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from services.worker.token_tables import BadWordsTable, TokenMaskTable, TokenTable
from shared.sampling_params import SamplingParams, wrap_int64


def _array(dtype: type, off: float, read: Callable[[SamplingParams], Any]) -> Any:
    """A [num_rows] array column: `off` in unused rows (and where the feature is off)."""
    return dataclasses.field(
        metadata={"make": lambda rows: np.full(rows, off, dtype=dtype), "read": read}
    )


def _table(make: Callable[[int], Any], read: Callable[[SamplingParams], Any]) -> Any:
    """A token-table column; `read` gives the row's entry as the table's `set` takes it."""
    return dataclasses.field(metadata={"make": make, "read": read})


def _or_minus_one(x: int | None) -> int:
    return -1 if x is None else x


@dataclass(frozen=True)
class SamplingColumns:
    """Per-row sampling parameters; build with `allocate`."""

    temperature: np.ndarray = _array(np.float32, 1.0, lambda p: p.temperature)
    top_p: np.ndarray = _array(np.float32, 1.0, lambda p: 1.0 if p.greedy else p.top_p)
    top_k: np.ndarray = _array(np.int64, 0, lambda p: 0 if p.greedy else max(p.top_k, 0))
    min_p: np.ndarray = _array(np.float32, 0.0, lambda p: 0.0 if p.greedy else p.min_p)
    seed: np.ndarray = _array(np.int64, 0, lambda p: wrap_int64(p.seed or 0))
    has_seed: np.ndarray = _array(np.bool_, False, lambda p: p.seed is not None)
    num_logprobs: np.ndarray = _array(np.int64, -1, lambda p: _or_minus_one(p.logprobs))
    logprobs_mode: np.ndarray = _array(np.int8, 0, lambda p: p.logprobs_mode_index)
    num_prompt_logprobs: np.ndarray = _array(
        np.int64, -1, lambda p: _or_minus_one(p.prompt_logprobs)
    )
    min_tokens: np.ndarray = _array(np.int64, 0, lambda p: p.min_tokens)
    repetition_penalty: np.ndarray = _array(np.float32, 1.0, lambda p: p.repetition_penalty)
    frequency_penalty: np.ndarray = _array(np.float32, 0.0, lambda p: p.frequency_penalty)
    presence_penalty: np.ndarray = _array(np.float32, 0.0, lambda p: p.presence_penalty)
    stop_token_ids: TokenTable = _table(TokenTable, lambda p: p.stop_token_ids)  # min_tokens
    allowed_token_ids: TokenMaskTable = _table(TokenMaskTable, lambda p: p.allowed_token_ids)
    logit_bias: TokenTable = _table(partial(TokenTable, with_values=True), lambda p: p.logit_bias)
    bad_words: BadWordsTable = _table(BadWordsTable, lambda p: p.bad_words_token_ids)

    @classmethod
    def allocate(cls, num_rows: int) -> SamplingColumns:
        return cls(**{f.name: f.metadata["make"](num_rows) for f in _FIELDS})

    def set(self, row: int, params: SamplingParams) -> None:
        for f in _FIELDS:
            column, value = getattr(self, f.name), f.metadata["read"](params)
            if isinstance(column, np.ndarray):
                column[row] = value
            else:
                column.set(row, value)

    def move(self, src: int, dst: int) -> None:
        for f in _FIELDS:
            column = getattr(self, f.name)
            if isinstance(column, np.ndarray):
                column[dst] = column[src]
            else:
                column.move(src, dst)


_FIELDS = dataclasses.fields(SamplingColumns)
