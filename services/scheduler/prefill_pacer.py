"""Sizing of long prefill chunks from one worker's measured step times.

A long prompt's chunk grows in cost with its context (attention reads every earlier token), and
what a token costs next to a decode step depends on the device, so chunks are sized in seconds
rather than tokens. The worker reports each step's time (`ModelRunnerOutput.execute_s`); from
it the pacer keeps the time of a decode-only step (no prefill chunk), as an exponential moving
average, and models the rest of a step, its prefill seconds, as

    prefill seconds = fixed + tokens * per_token + work * per_work

per prefilling request: the step's time, less the decode-only time when the step also decoded,
against the step's prefill tokens and their attention work (each chunk's tokens times their
mean context). `fixed` is what a step pays whatever its chunk: on a CPU, reading all weights
once (in a step alone; next to decodes it is in the decode-only time) and gathering the
request's KV context again. The parts are fitted by least squares over the request's last
`HISTORY` steps, with one `fixed` for steps alone and one for steps next to decodes, once they
are three and their tokens spread enough (`MIN_SPREAD`) to tell `fixed` from the rest; the work
term only where tokens and work do not move together (else the per-token part takes it). A
fitted `fixed` is kept until the next fit. A request's seconds per token is then its latest
step's seconds less `fixed` (0 until fitted: seconds over tokens, as without the model), over
its tokens, so it follows the growing context; `fixed` is clamped to leave the tokens at least
`MIN_TOKEN_PART` of the step, a fit lowers the seconds per token at most `MAX_SPEEDUP` times a
step, and between fits they are smoothed. Chunks are at least `MIN_CHUNK` tokens (one token
would be taken for a decode and its step never measured); a request stuck there, with no
`fixed` fitted, is probed with `fixed` at its clamp, a larger chunk to fit after. As the
context grows so does `fixed` (the gather) while chunks barely change, so a request whose
`fixed` is a large part of its step (`DITHER_FIXED_PART`) has one chunk in `HISTORY` + 1
without a fit halved, for the next fit. A request's first chunk uses the latest seconds per
token of any request.

A step's long chunks then get at most `long_prefill_step_time` seconds of per-token time in all
and, while other requests decode, at most `long_prefill_share` of the step:
`decode_s * share / (1 - share)`. The fixed part is not charged to the budget: where it alone
exceeds the budget, a chunk still gets budget / per_token tokens (the step takes fixed +
budget, which is unavoidable) rather than shrinking toward one token. If requests decode and
no decode-only step was measured yet, long chunks sit out one step so that it is. Until a
prefill step of the worker was timed the rate is unknown (the scheduler then cuts a long
prompt's chunk to the long-prefill threshold, to measure it); wherever steps report no time
(the offline engine) nothing is cut.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from shared.config import SchedulerConfig
from shared.wire import ModelRunnerOutput

SMOOTHING = 0.5  # weight of the newest measurement in the moving averages
HISTORY = 4  # a request's latest steps its fixed part is fitted over
MIN_SPREAD = 0.25  # a fit's token counts must spread by this fraction of the largest
MIN_INDEPENDENCE = 0.05  # 1 - correlation**2 of tokens and attention work, to fit both
MIN_TOKEN_PART = 0.05  # the per-token part is at least this fraction of a step's seconds
MAX_SPEEDUP = 2.0  # a step lowers a request's seconds per token at most this many times
# a request whose fixed part is at least this share of its step and went HISTORY steps without
# a fit has its next chunk halved, for the next fit to tell the fixed part from the rest
DITHER_FIXED_PART = 0.25
# a one-token chunk would be recorded as a decode, and its step never measured as a prefill
MIN_CHUNK = 2


def _average(old: float, new: float) -> float:
    return new if old <= 0.0 else old + SMOOTHING * (new - old)


@dataclass(frozen=True, slots=True)
class _Observation:
    decoding: bool  # whether the step also decoded (its decode-only time was subtracted)
    tokens: int  # the step's prefill tokens
    work: float  # sum over its chunks of tokens * their mean context: attention's share
    seconds: float  # the step's prefill seconds


@dataclass(slots=True)
class _PrefillCost:
    """One prefilling request's step-time model."""

    steps: deque[_Observation] = field(default_factory=lambda: deque(maxlen=HISTORY))
    fixed_s: dict[bool, float] = field(default_factory=dict)  # decoding -> fitted intercept
    token_s: float = 0.0  # seconds per prefill token at its latest context; 0: not measured
    unfitted: int = 0  # steps since the latest fit
    dither: bool = False  # whether its next chunk is halved


def _centered(steps: deque[_Observation]) -> list[tuple[float, float, float]]:
    """(tokens, work, seconds) of the steps less their means over steps of the same kind
    (alone or next to decodes), so that each kind gets its own intercept."""
    rows = []
    for decoding in (False, True):
        group = [s for s in steps if s.decoding == decoding]
        if len(group) < 2:
            continue
        tokens = sum(s.tokens for s in group) / len(group)
        work = sum(s.work for s in group) / len(group)
        seconds = sum(s.seconds for s in group) / len(group)
        rows += [(s.tokens - tokens, s.work - work, s.seconds - seconds) for s in group]
    return rows


def _fit(steps: deque[_Observation]) -> tuple[float, float] | None:
    """Least-squares (seconds per token, seconds per unit of attention work) of the steps,
    an intercept per kind of step; the second 0 where tokens and work move together or it
    comes out negative. None with fewer than three steps, too little spread in their tokens
    or a slope that is not positive."""
    rows = _centered(steps)
    largest = max(s.tokens for s in steps)
    sxx = sum(t * t for t, _, _ in rows)
    # two steps MIN_SPREAD apart give sxx = (MIN_SPREAD * largest)**2 / 2
    if len(steps) < 3 or sxx < 0.5 * (MIN_SPREAD * largest) ** 2:
        return None
    sxw = sum(t * w for t, w, _ in rows)
    sww = sum(w * w for _, w, _ in rows)
    sxy = sum(t * y for t, _, y in rows)
    swy = sum(w * y for _, w, y in rows)
    det = sxx * sww - sxw * sxw
    if sww > 0.0 and det >= MIN_INDEPENDENCE * sxx * sww:
        token_s = (sxy * sww - swy * sxw) / det
        work_s = (swy * sxx - sxy * sxw) / det
        if token_s > 0.0 and work_s >= 0.0:
            return token_s, work_s
    return (sxy / sxx, 0.0) if sxy > 0.0 else None


class PrefillPacer:
    """Step-time bookkeeping of one worker and the time its next step gives long prefills."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.step_time = config.long_prefill_step_time
        self.share = config.long_prefill_share
        self.decode_s = 0.0  # decode-only step time; 0: not measured
        self.costs: dict[str, _PrefillCost] = {}  # req_id -> its step-time model
        self.last_token_s = 0.0  # any request's latest, for first chunks; 0: not measured
        # step_id -> (prefill (tokens, context) by request, decode tokens), until its result
        self._steps: dict[int, tuple[dict[str, tuple[int, int]], int]] = {}

    @property
    def enabled(self) -> bool:
        return self.step_time > 0.0 or self.share < 1.0

    def rate(self, req_id: str) -> float:
        """Seconds per prefill token of a request's next chunk, its fixed part left out; 0
        when none was measured."""
        cost = self.costs.get(req_id)
        if cost is None:
            return self.last_token_s
        return 2.0 * cost.token_s if cost.dither else cost.token_s

    def step_budget(self, decoding: bool) -> float:
        """Seconds of per-token time the long prefill chunks of the next step may take (inf:
        no limit, 0: none this step); `decoding`: whether running requests decode in it."""
        if not self.enabled:
            return math.inf
        budget = self.step_time if self.step_time > 0.0 else math.inf
        if decoding and self.share < 1.0:
            if self.decode_s <= 0.0:
                return 0.0  # measure a decode-only step first
            budget = min(budget, self.decode_s * self.share / (1.0 - self.share))
        return budget

    @staticmethod
    def chunk(num_tokens: int, rate: float, seconds: float) -> int:
        """Tokens of a chunk, at most `num_tokens`, that take `seconds` at `rate` seconds per
        token; at least `MIN_CHUNK` while any time is left (a long prompt is never starved)."""
        if rate <= 0.0 or math.isinf(seconds):
            return num_tokens
        if seconds <= 0.0:
            return 0
        return min(num_tokens, max(MIN_CHUNK, int(seconds / rate)))

    def record(self, step_id: int, prefill: dict[str, tuple[int, int]], num_decode: int) -> None:
        """Remember what a planned step holds, to attribute its time when its result comes;
        `prefill`: req_id -> (chunk tokens, tokens computed before the chunk)."""
        if self.enabled and (prefill or num_decode):
            self._steps[step_id] = (prefill, num_decode)

    def observe(self, output: ModelRunnerOutput) -> None:
        """Learn from a step's measured time (steps before it without a result are dropped)."""
        for step_id in [s for s in self._steps if s < output.step_id]:
            del self._steps[step_id]
        step = self._steps.pop(output.step_id, None)
        if step is None or output.execute_s <= 0.0:
            return
        prefill, num_decode = step
        if not prefill:
            self.decode_s = _average(self.decode_s, output.execute_s)
            return
        decoding = num_decode > 0
        seconds = output.execute_s - (self.decode_s if decoding else 0.0)
        if seconds <= 0.0:
            return
        # the step's chunks share its time: each request's model sees the whole step
        tokens = sum(n for n, _ in prefill.values())
        work = sum(n * (context + (n + 1) / 2) for n, context in prefill.values())
        observation = _Observation(decoding, tokens, work, seconds)
        for req_id in prefill:
            cost = self.costs.setdefault(req_id, _PrefillCost())
            self.last_token_s = self._learn(cost, observation)

    @staticmethod
    def _learn(cost: _PrefillCost, observation: _Observation) -> float:
        """Add a step to a request's model; returns its new seconds per token."""
        cost.steps.append(observation)
        decoding, tokens, seconds = observation.decoding, observation.tokens, observation.seconds
        fit = _fit(cost.steps)
        cost.unfitted = 0 if fit is not None else cost.unfitted + 1
        if fit is not None:
            token_s, work_s = fit
            group = [s for s in cost.steps if s.decoding == decoding]
            cost.fixed_s[decoding] = sum(
                s.seconds - token_s * s.tokens - work_s * s.work for s in group
            ) / len(group)
        max_fixed_s = (1 - MIN_TOKEN_PART) * seconds
        # stuck at the smallest chunk, whose tokens vary too little to fit a line through:
        # probe with the fixed part at its bound, a larger chunk, to fit after it
        probe = (
            decoding not in cost.fixed_s
            and len(cost.steps) > 1
            and all(s.tokens <= MIN_CHUNK for s in list(cost.steps)[-2:])
        )
        fixed_s = max_fixed_s if probe else cost.fixed_s.get(decoding, 0.0)
        fixed_s = min(max(fixed_s, 0.0), max_fixed_s)
        token_s = (seconds - fixed_s) / tokens
        # the fixed part grows with the context (the KV gather) while chunks barely change
        cost.dither = (
            not probe
            and cost.unfitted > 0
            and cost.unfitted % HISTORY == 0
            and fixed_s >= DITHER_FIXED_PART * seconds
        )
        if probe or cost.token_s <= 0.0:
            cost.token_s = token_s
        elif fit is not None:  # a new fit replaces the old estimate, within limits
            cost.token_s = max(token_s, cost.token_s / MAX_SPEEDUP)
        else:  # between fits noise is smoothed out
            cost.token_s = _average(cost.token_s, token_s)
        return cost.token_s

    def forget(self, req_id: str) -> None:
        self.costs.pop(req_id, None)
