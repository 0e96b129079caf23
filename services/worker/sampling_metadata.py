"""SamplingMetadata for one step's sampled rows, gathered from the persistent batch (vLLM:
InputBatch._make_sampling_metadata); the sampler package only consumes the result.

Every field is a numpy gather over the step's rows (no loop over requests); a feature that no
row uses becomes None, and host-side flags (all greedy, any temperature, max top-k) spare the
sampler any device sync to find out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from services.worker.input_batch import InputBatch
from services.worker.sampler.metadata import (
    Allowed,
    BadWords,
    Filters,
    GrammarMask,
    LogprobsSpec,
    Penalties,
    SamplingMetadata,
    TokenBias,
    TokenRows,
)
from services.worker.sampling_columns import SamplingColumns
from services.worker.token_tables import TokenTable
from shared.sampling_params import LOGPROBS_MODES, is_greedy

# By logprobs_mode index: a raw_* mode (else processed_*), *_logprobs (else *_logits).
_RAW_MODE = np.array([mode.startswith("raw_") for mode in LOGPROBS_MODES])
_AS_LOGPROBS = np.array([mode.endswith("_logprobs") for mode in LOGPROBS_MODES])


def build_sampling_metadata(
    batch: InputBatch,
    rows: np.ndarray,
    vocab_size: int,
    eos_token_ids: Sequence[int],
    device: torch.device | str = "cpu",
    grammar: GrammarMask | None = None,
) -> SamplingMetadata:
    """rows: [n] persistent-batch rows, in the order of the logits' rows; `grammar`: the
    step's structured-output masks (the runner fills them while the forward runs)."""
    dev, cols = torch.device(device), batch.sampling
    temperature = cols.temperature[rows]  # [n]
    greedy = is_greedy(temperature)  # [n] bool
    output_len = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]  # [n]
    return SamplingMetadata(
        temperature=_tensor(temperature, dev),
        all_greedy=bool(greedy.all()),
        all_random=bool(greedy.size) and not bool(greedy.any()),
        needs_temperature=bool((~greedy & (temperature != 1.0)).any()),
        random_rows=_tensor(np.flatnonzero(~greedy), dev),
        seeded=_tensor(cols.has_seed[rows], dev),
        seeds=_tensor(cols.seed[rows], dev),
        output_positions=_tensor(output_len, dev),
        filters=_filters(cols, rows, vocab_size, dev),
        allowed=_allowed(cols, rows, vocab_size, dev),
        bad_words=_bad_words(batch, rows, dev),
        min_tokens=_min_tokens(batch, rows, output_len, eos_token_ids, dev),
        logit_bias=_logit_bias(cols.logit_bias, rows, dev),
        penalties=_penalties(batch, rows, dev),
        grammar=grammar,
        logprobs=_logprobs(cols, rows, dev),
    )


def _tensor(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(arr)).to(device)


def _filters(
    cols: SamplingColumns, rows: np.ndarray, vocab: int, device: torch.device
) -> Filters | None:
    """Greedy rows have every filter off already (SamplingColumns)."""
    min_p, top_p, top_k = cols.min_p[rows], cols.top_p[rows], cols.top_k[rows]
    top_k = np.where(top_k < vocab, top_k, 0)  # k >= vocab keeps all
    sel = np.flatnonzero((min_p > 0.0) | (top_k > 0) | (top_p < 1.0))
    if not sel.size:
        return None
    return Filters(
        rows=_tensor(sel, device),
        min_p=_tensor(min_p[sel], device),
        top_k=_tensor(top_k[sel], device),
        top_p=_tensor(top_p[sel], device),
        max_top_k=int(top_k[sel].max()),
        any_top_p=bool((top_p[sel] < 1.0).any()),
    )


def _allowed(
    cols: SamplingColumns, rows: np.ndarray, vocab: int, device: torch.device
) -> Allowed | None:
    sel = np.flatnonzero(cols.allowed_token_ids.has[rows])
    if not sel.size:
        return None
    banned = cols.allowed_token_ids.non_members(rows[sel], vocab)
    return Allowed(_tensor(sel, device), _tensor(banned, device))


def _logit_bias(table: TokenTable, rows: np.ndarray, device: torch.device) -> TokenBias | None:
    """The biases of `rows` in `table` (a table with values)."""
    sel = np.flatnonzero(table.has[rows])
    if not sel.size or table.values is None:
        return None
    picked = rows[sel]
    ids, values = _tensor(table.ids[picked], device), _tensor(table.values[picked], device)
    return TokenBias(_tensor(sel, device), ids, values)


def _bad_words(batch: InputBatch, rows: np.ndarray, device: torch.device) -> BadWords | None:
    table = batch.sampling.bad_words
    sel = np.flatnonzero(table.has[rows])
    if not sel.size:
        return None
    picked = rows[sel]
    words = table.words[picked]  # [r, num_words, word_len]
    positions = batch.num_tokens[picked, None] - words.shape[2] + 1 + np.arange(words.shape[2] - 1)
    in_output = positions >= batch.num_prompt_tokens[picked, None]  # [r, word_len - 1]
    tokens = batch.token_ids[picked[:, None], np.maximum(positions, 0)]
    history = np.where(in_output, tokens, -2)
    return BadWords(_tensor(sel, device), _tensor(words, device), _tensor(history, device))


def _min_tokens(
    batch: InputBatch,
    rows: np.ndarray,
    output_len: np.ndarray,
    eos_token_ids: Sequence[int],
    device: torch.device,
) -> TokenRows | None:
    """Rows still below min_tokens, with their stop ids and every EOS id to ban (vLLM bans
    EOS there even with ignore_eos), but for rows whose grammar is complete (EOS is all it
    allows: the grammar wins)."""
    cols, eos = batch.sampling, np.asarray(eos_token_ids, dtype=np.int64)
    below = output_len < cols.min_tokens[rows]
    for i in np.flatnonzero(below & batch.has_matcher[rows]).tolist():
        below[i] = not batch.matchers[rows[i]].is_stopped()
    has_stop = cols.stop_token_ids.has[rows]
    sel = np.flatnonzero(below & (has_stop | (eos.size > 0)))
    if not sel.size:
        return None
    stop = cols.stop_token_ids.ids[rows[sel]]  # [r, width]
    if eos.size:  # rows without stop ids repeat an EOS id instead
        stop = np.where(has_stop[sel, None], stop, eos[0])
    ids = np.concatenate((stop, np.broadcast_to(eos, (sel.size, eos.size))), axis=1)
    return TokenRows(_tensor(sel, device), _tensor(ids, device))


def _penalties(batch: InputBatch, rows: np.ndarray, device: torch.device) -> Penalties | None:
    cols = batch.sampling
    rep, freq = cols.repetition_penalty[rows], cols.frequency_penalty[rows]
    pres = cols.presence_penalty[rows]
    sel = np.flatnonzero((rep != 1.0) | (freq != 0.0) | (pres != 0.0))
    if not sel.size:
        return None
    picked = rows[sel]
    lengths = batch.num_tokens[picked, None]  # [r, 1]
    positions = np.arange(int(lengths.max()))
    in_history = positions < lengths  # [r, max_len]
    ids = batch.token_ids[picked, : positions.size]
    ids = np.where(in_history, ids, ids[:, :1])
    is_output = in_history & (positions >= batch.num_prompt_tokens[picked, None])
    return Penalties(
        rows=_tensor(sel, device),
        token_ids=_tensor(ids, device),
        is_output=_tensor(is_output, device),
        repetition=_tensor(rep[sel], device),
        frequency=_tensor(freq[sel], device),
        presence=_tensor(pres[sel], device),
    )


def _logprobs(cols: SamplingColumns, rows: np.ndarray, device: torch.device) -> LogprobsSpec | None:
    num = cols.num_logprobs[rows]
    wanted = num >= 0
    if not wanted.any():
        return None
    mode = cols.logprobs_mode[rows]  # [n] LOGPROBS_MODES index
    raw_mode = _RAW_MODE[mode]
    raw, processed = np.flatnonzero(wanted & raw_mode), np.flatnonzero(wanted & ~raw_mode)
    return LogprobsSpec(
        num_logprobs=num.tolist(),
        raw_rows=_tensor(raw, device) if raw.size else None,
        processed_rows=_tensor(processed, device) if processed.size else None,
        as_logprobs=_tensor(_AS_LOGPROBS[mode], device),
    )
