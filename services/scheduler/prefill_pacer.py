"""Sizing of long prefill chunks from one worker's measured step times.

A long prompt's chunk grows in cost with its context (attention reads every earlier token), and
what a token costs next to a decode step depends on the device, so chunks are sized in seconds
rather than tokens. The worker reports each step's time (`ModelRunnerOutput.execute_s`); from
it the pacer keeps

- the time of a decode-only step (no prefill chunk), as an exponential moving average, and
- each prefilling request's seconds per prompt token in its last chunk: the step's time, less
  the decode-only time when the step also decoded, over the step's prefill tokens. A request's
  first chunk uses the latest rate of any request.

A step's long chunks then get at most `long_prefill_step_time` seconds in all and, while other
requests decode, at most `long_prefill_share` of the step: `decode_s * share / (1 - share)`. If
requests decode and no decode-only step was measured yet, long chunks sit out one step so that
it is. Until a prefill step of the worker was timed the rate is unknown (the scheduler then
cuts a long prompt's chunk to the long-prefill threshold, to measure it); wherever steps report
no time (the offline engine) nothing is cut.
"""

from __future__ import annotations

import math

from shared.config import SchedulerConfig
from shared.wire import ModelRunnerOutput

SMOOTHING = 0.5  # weight of the newest measurement in the moving averages


def _average(old: float, new: float) -> float:
    return new if old <= 0.0 else old + SMOOTHING * (new - old)


class PrefillPacer:
    """Step-time bookkeeping of one worker and the time its next step gives long prefills."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.step_time = config.long_prefill_step_time
        self.share = config.long_prefill_share
        self.decode_s = 0.0  # decode-only step time; 0: not measured
        self.token_s: dict[str, float] = {}  # req_id -> seconds per prefill token
        self.last_token_s = 0.0  # any request's latest, for first chunks; 0: not measured
        # step_id -> (prefill tokens by request, decode tokens), until the step's result
        self._steps: dict[int, tuple[dict[str, int], int]] = {}

    @property
    def enabled(self) -> bool:
        return self.step_time > 0.0 or self.share < 1.0

    def rate(self, req_id: str) -> float:
        """Seconds per prefill token of a request's next chunk; 0 when none was measured."""
        return self.token_s.get(req_id, self.last_token_s)

    def step_budget(self, decoding: bool) -> float:
        """Seconds the long prefill chunks of the next step may take (inf: no limit, 0: none
        this step); `decoding`: whether running requests decode in it."""
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
        token; at least one while any time is left (a long prompt is never starved)."""
        if rate <= 0.0 or math.isinf(seconds):
            return num_tokens
        if seconds <= 0.0:
            return 0
        return min(num_tokens, max(1, int(seconds / rate)))

    def record(self, step_id: int, prefill: dict[str, int], num_decode: int) -> None:
        """Remember what a planned step holds, to attribute its time when its result comes."""
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
        decode_s = self.decode_s if num_decode else 0.0
        token_s = max(output.execute_s - decode_s, 0.0) / sum(prefill.values())
        if token_s <= 0.0:
            return
        self.last_token_s = token_s
        for req_id in prefill:
            self.token_s[req_id] = _average(self.token_s.get(req_id, 0.0), token_s)

    def forget(self, req_id: str) -> None:
        self.token_s.pop(req_id, None)
