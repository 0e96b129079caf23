"""What a worker process answers on /health and /ready (`shared.http_probes`)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Protocol

from shared.http_probes import Check


class StepWatch:
    """Tells a wedged step: one that made no progress (decoder layers run, as the runner
    counts them) for longer than `timeout_s` and than `factor` times the moving average of
    recent steps (`alpha`: the newest step's weight), so a long prefill that keeps running
    layers is never wedged. `begin` and `end` are called from the event loop, `check` from
    the probe server's thread."""

    def __init__(self, timeout_s: float, factor: float, alpha: float = 0.1) -> None:
        self.timeout_s, self.factor, self.alpha = timeout_s, factor, alpha
        self.mean_s: float | None = None  # None before the first step with tokens
        self._started: float | None = None  # time.monotonic() of the running step
        self._progress = (0, 0.0)  # the runner's progress counter when last seen to change

    def begin(self) -> None:
        self._started = time.monotonic()

    def end(self, seconds: float, *, count: bool = True) -> None:
        """The step ended after `seconds`; `count`: it enters the average (empty plans do not,
        they take no time)."""
        self._started = None
        if count:
            mean = self.mean_s
            self.mean_s = seconds if mean is None else mean + self.alpha * (seconds - mean)

    def check(self, progress: int = 0) -> str | None:
        """Why the running step is wedged (None: it is not); `progress` is the runner's
        counter now."""
        started = self._started  # read once: the loop may end the step meanwhile
        now = time.monotonic()
        if progress != self._progress[0]:
            self._progress = (progress, now)
        if started is None:
            return None
        stalled = now - max(started, self._progress[1])
        limit = max(self.timeout_s, self.factor * (self.mean_s or 0.0))
        if stalled <= limit:
            return None
        return f"a step has made no progress for {stalled:.0f} s (wedged after {limit:.0f} s)"


class Probed(Protocol):
    """What the probes read of a WorkerService."""

    def live(self) -> str | None: ...

    def ready(self) -> str | None: ...


class WorkerProbes:
    """The checks of one worker process: until `services` are set the model is loading (both
    probes fail; Kubernetes' startupProbe allows for it), then the event loop must respond
    (`loop_check`) and each worker must pass."""

    def __init__(self, loop_check: Check) -> None:
        self.loop_check = loop_check
        self.services: Sequence[Probed] = ()

    def live(self) -> str | None:
        if not self.services:
            return "loading the model"
        return self.loop_check() or _first(s.live() for s in self.services)

    def ready(self) -> str | None:
        if not self.services:
            return "loading the model"
        return _first(s.ready() for s in self.services)


def _first(reasons: Iterable[str | None]) -> str | None:
    return next((r for r in reasons if r is not None), None)
