"""The sampler: logits of the batch's sampling rows -> next tokens (+ logprobs).

Order (vLLM's semantics; see docs/architecture.md): float32 (a working copy when raw logprobs
are wanted) -> allowed_token_ids -> bad words -> min_tokens -> logit_bias -> penalties ->
structured-output grammar mask -> greedy argmax, or temperature -> min_p -> top-k -> top-p ->
(snapshot for processed logprobs) -> sample -> top logprobs with the sampled token's value and rank.

Every step works on the whole batch at once and is skipped when no row needs it (its metadata
is None). The steps change the logits in place: the caller's, or the working copy that keeps
them raw for raw logprobs (filled by the whitelist's pass when there is one); the caller's
logits may be overwritten either way. Randomness: see `random.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.sampler import block_topk, processors, topk_topp
from services.worker.sampler.logit_stats import LogitStats, fused, logit_stats
from services.worker.sampler.logprobs import scatter_rows, top_logprobs
from services.worker.sampler.metadata import LogprobsSpec, SamplingMetadata
from services.worker.sampler.penalties import apply_penalties
from services.worker.sampler.random import row_uniforms, sample_candidates, sample_inverse_cdf
from services.worker.sampler.topk_topp import Cutoffs, divided, mask_below, rows_of


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    # With logprobs requested: [num_reqs, 1 + max_logprobs] ids / values, sampled token first;
    # rows that asked for none hold zeros.
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None  # [num_reqs] 1-based rank of the sampled token


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._generator = torch.Generator()  # unseeded rows only
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._buffers: dict[str, torch.Tensor] = {}  # logprobs snapshots, reused across steps

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [num_reqs, vocab_size], may be overwritten -> one token per row."""
        if not len(logits):
            return SamplerOutput(torch.empty(0, dtype=torch.long, device=logits.device))
        lp = meta.logprobs
        raw_rows = lp.raw_rows if lp is not None else None
        x, allowed_done, raw_stats = self._working_logits(logits, meta, raw_rows)
        apply_logit_processors(x, meta, allowed_done)
        if meta.penalties is not None:
            apply_penalties(x, meta.penalties)
        if meta.grammar is not None:
            words = meta.grammar.bitmask.shape[1]
            buffer = self._buffer("grammar", (len(x) * words * 32,), x.device)
            processors.apply_grammar_mask(x, meta.grammar, buffer)
        sampled, processed = self._sample(x, meta)
        result = SamplerOutput(sampled_token_ids=sampled)
        if lp is not None:
            raw = None if raw_rows is None else rows_of(logits, raw_rows).float()
            _attach_logprobs(result, lp, raw, processed, raw_stats)
        return result

    def _working_logits(
        self, logits: torch.Tensor, meta: SamplingMetadata, raw_rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, bool, LogitStats | None]:
        """fp32 logits for the in-place steps ([n, vocab]), whether the allowed-token
        whitelist is applied already, and the raw logits' LogitStats where they came on the way.
        When raw logprobs (raw_rows) need the logits untouched: a buffer kept across steps,
        filled by the whitelist's pass where it covers every row (no separate copy), which
        also takes the raw stats where every row wants them and the C++ op runs; logits
        itself is then left unchanged."""
        if raw_rows is None or not meta.changes_logits or logits.dtype != torch.float32:
            return logits.float(), False, None  # a copy unless logits are fp32 already
        work = self._buffer("work", logits.shape, logits.device)[: len(logits)]
        allowed = meta.allowed
        if allowed is not None and len(allowed.rows) < len(logits):
            allowed = None  # a whitelist of some rows only is applied in place later
        if fused(logits) and len(raw_rows) == len(logits):
            banned = None if allowed is None else allowed.banned
            return work, allowed is not None, logit_stats(logits, banned, out=work)
        if allowed is not None:
            return processors.apply_allowed_token_ids(logits, allowed, out=work), True, None
        return work.copy_(logits), False, None

    def _sample(
        self, logits: torch.Tensor, meta: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        lp = meta.logprobs
        processed_rows = lp.processed_rows if lp is not None else None
        if meta.all_greedy:
            return block_topk.argmax(logits), self._snapshot("processed", logits, processed_rows)
        greedy = None if meta.all_random else block_topk.argmax(logits)
        divisor = None
        if meta.needs_temperature:
            divisor = topk_topp.temperature_divisor(meta.temperature)  # [n, 1]
        cut = None
        if meta.filters is not None:
            cut = topk_topp.compute_cutoffs(logits, meta.filters, divisor)
        processed = self._snapshot("processed", logits, processed_rows, divisor)
        if processed is not None and cut is not None:
            mask_below(processed, cut.threshold[processed_rows])
        u = row_uniforms(meta.seeded, meta.seeds, meta.output_positions, self._generator)
        sampled = draw(logits, meta.random_rows, cut, u, divisor)
        if greedy is not None:
            sampled = torch.where(meta.greedy_mask, greedy, sampled)
        return sampled, processed

    def _snapshot(
        self,
        name: str,
        logits: torch.Tensor,
        rows: torch.Tensor | None,
        divisor: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """fp32 copy of logits[rows] ([r, vocab]), divided by divisor[rows] ([n, 1]) if given,
        in a buffer kept across steps (no fresh 50 MB allocation per step); None without
        rows."""
        if rows is None:
            return None
        src = rows_of(logits, rows)
        out = self._buffer(name, src.shape, src.device)[: len(src)]
        if divisor is None:
            return out.copy_(src)
        return torch.div(src, rows_of(divisor, rows), out=out)

    def _buffer(
        self, name: str, shape: torch.Size | tuple[int, ...], device: torch.device
    ) -> torch.Tensor:
        """An fp32 buffer of at least `shape` (more rows allowed), kept across steps."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < shape[0] or buf.shape[1:] != shape[1:]:
            buf = torch.empty(shape, dtype=torch.float32, device=device)
            self._buffers[name] = buf
        return buf


def draw(
    logits: torch.Tensor,
    rows: torch.Tensor,
    cut: Cutoffs | None,
    u: torch.Tensor,
    divisor: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token for each of `rows` ([n] result; other rows hold 0). Rows with a small kept
    set sample from it; the others from their full row, divided by divisor ([n, 1], the
    temperature) and masked. logits: [n, vocab] before temperature, overwritten."""
    tokens = torch.zeros(len(logits), dtype=torch.long, device=logits.device)
    full = rows
    if cut is not None and cut.small is not None:
        small = cut.small
        tokens[small.rows] = sample_candidates(small.values, small.ids, u[small.rows])
        is_full = torch.zeros(len(logits), dtype=torch.bool, device=logits.device)
        is_full[rows] = True
        is_full[small.rows] = False
        full = torch.nonzero(is_full).squeeze(1)
    if full.numel():
        x = divided(rows_of(logits, full), None if divisor is None else rows_of(divisor, full))
        if cut is not None:
            mask_below(x, rows_of(cut.threshold, full))
        tokens[full] = sample_inverse_cdf(x, u[full])
    return tokens


def apply_logit_processors(
    logits: torch.Tensor, meta: SamplingMetadata, allowed_done: bool = False
) -> None:
    """Whitelist (unless `allowed_done`), bad words, then the processors that can change greedy
    results."""
    if meta.allowed is not None and not allowed_done:
        processors.apply_allowed_token_ids(logits, meta.allowed)
    if meta.bad_words is not None:
        processors.apply_bad_words(logits, meta.bad_words)
    if meta.min_tokens is not None:
        processors.ban_tokens(logits, meta.min_tokens)
    if meta.logit_bias is not None:
        processors.apply_logit_bias(logits, meta.logit_bias)


def _attach_logprobs(
    result: SamplerOutput,
    lp: LogprobsSpec,
    raw: torch.Tensor | None,
    processed: torch.Tensor | None,
    raw_stats: LogitStats | None = None,
) -> None:
    """raw / processed: the logits of lp.raw_rows / lp.processed_rows (None: no such rows);
    raw_stats: raw's LogitStats where already taken (else the C++ op takes them where it
    runs)."""
    sampled = result.sampled_token_ids
    parts = []
    for rows, values, stats in (
        (lp.raw_rows, raw, raw_stats),
        (lp.processed_rows, processed, None),
    ):
        if rows is None or values is None:
            continue
        if stats is None and fused(values):
            stats = logit_stats(values)
        part = top_logprobs(values, sampled[rows], lp.max_num, lp.as_logprobs[rows], stats)
        parts.append((rows, part))
    top = scatter_rows(parts, len(sampled))
    result.logprob_token_ids, result.logprobs, result.sampled_ranks = (
        top.token_ids,
        top.values,
        top.ranks,
    )
