"""The persistent batch: one row per request held by the worker, in preallocated arrays.

Rows change only by the per-step diff (add, remove, extend the block table, append a sampled
token); `condense` fills holes left by removed requests so rows stay dense. With a
`GrammarCompiler`, a structured request's row holds its grammar matcher: built (replaying the
output so far) when the request enters the batch, advanced with each appended token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Self, TypeVar

import numpy as np

from services.worker.grammar import advance
from services.worker.sampling_columns import SamplingColumns
from shared.arith import cdiv
from shared.sampling_params import SamplingParams
from shared.wire import BatchPlan, LoRARequest, NewRequestData

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from services.worker.grammar import GrammarCompiler


@dataclass
class CachedRequestState:
    """Everything the worker knows about one request, in or out of the batch."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt logprob entries already sent (entry i: prompt token i; entry 0 is None).
    num_prompt_logprobs_sent: int = 0
    lora: LoRARequest | None = None  # the adapter it runs with; None: the base model

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @classmethod
    def from_new(cls, new: NewRequestData) -> Self:
        return cls(
            req_id=new.req_id,
            prompt_token_ids=new.prompt_token_ids,
            sampling_params=new.sampling_params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            output_token_ids=list(new.output_token_ids),
            lora=new.lora,
        )


S = TypeVar("S", bound=CachedRequestState)


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        grammar: GrammarCompiler | None = None,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        max_blocks = cdiv(max_model_len, block_size)
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.num_reqs = 0  # rows 0..num_reqs-1 are in use after condense()
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.sampling = SamplingColumns.allocate(max_num_reqs)
        self.grammar = grammar  # None: structured outputs are not enforced (the sim runner)
        self.matchers: list[LLMatcher | None] = [None] * max_num_reqs
        self.has_matcher = np.zeros(max_num_reqs, dtype=bool)

    def add_request(self, state: CachedRequestState) -> int:
        """Append a row; call after `condense` so that rows stay dense."""
        row = self.num_reqs
        if row >= self.max_num_reqs:
            raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} rows)")
        self.req_ids[row] = state.req_id
        self.req_id_to_index[state.req_id] = row
        self.num_reqs += 1
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(state.prompt_token_ids)
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_block_ids(row, state.block_ids)
        self.sampling.set(row, state.sampling_params)
        structured = state.sampling_params.structured_outputs
        if structured is not None and self.grammar is not None:
            self.matchers[row] = self.grammar.matcher(structured, state.output_token_ids)
        self.has_matcher[row] = self.matchers[row] is not None
        return row

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one token to each of `rows` ([r] each)."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1
        for i in np.flatnonzero(self.has_matcher[rows]).tolist():
            advance(self.matchers[rows[i]], int(token_ids[i]))

    def structured(self, rows: np.ndarray) -> tuple[np.ndarray, list[LLMatcher]]:
        """Of `rows`: the indices of those with a grammar, and their matchers."""
        sel = np.flatnonzero(self.has_matcher[rows])
        return sel, [self.matchers[r] for r in rows[sel].tolist()]

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is not None:
            self.req_ids[row] = None
            self.matchers[row] = None
            self.has_matcher[row] = False

    def condense(self) -> None:
        """Move the last rows into holes so that rows 0..num_reqs-1 are all occupied."""
        num_reqs = len(self.req_id_to_index)
        last = self.num_reqs - 1
        for hole in range(num_reqs):
            if self.req_ids[hole] is not None:
                continue
            while (req_id := self.req_ids[last]) is None:
                last -= 1
            self._move(req_id, last, hole)
            last -= 1
        self.num_reqs = num_reqs

    def _move(self, req_id: str, src: int, dst: int) -> None:
        """Move request `req_id` from row `src` to the free row `dst`."""
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.req_id_to_index[req_id] = dst
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens):
            arr[dst] = arr[src]
        nb = self.num_blocks[src]
        self.num_blocks[dst] = nb
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        self.sampling.move(src, dst)
        self.matchers[dst], self.matchers[src] = self.matchers[src], None
        self.has_matcher[dst], self.has_matcher[src] = self.has_matcher[src], False


def apply_plan_diff(
    batch: InputBatch, requests: dict[str, S], plan: BatchPlan, state_cls: type[S]
) -> None:
    """Apply a plan's diff to a runner's requests and persistent batch, in the order a step
    needs: finished and preempted rows out, holes filled, new requests in, then the cached
    ones' new blocks and computed counts (a resumed one gets its block table anew)."""
    for req_id in plan.finished_req_ids:
        requests.pop(req_id, None)
        batch.remove_request(req_id)
    for req_id in plan.preempted_req_ids:
        batch.remove_request(req_id)
    batch.condense()
    for new in plan.new_reqs:
        state = state_cls.from_new(new)
        requests[new.req_id] = state
        batch.add_request(state)
    for cached in plan.cached_reqs:
        state = requests[cached.req_id]
        state.num_computed_tokens = cached.num_computed_tokens
        if cached.resumed:
            state.block_ids = list(cached.new_block_ids)
            batch.add_request(state)
            continue
        state.block_ids.extend(cached.new_block_ids)
        row = batch.req_id_to_index[cached.req_id]
        batch.append_block_ids(row, cached.new_block_ids)
        batch.num_computed_tokens[row] = cached.num_computed_tokens
