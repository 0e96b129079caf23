"""Phase times of one worker step: prepare (plan diff and input tensors), forward (the model and
its logits), sample (the sampler) and write-back (sampled tokens into the batch and the result).

On the CPU (and in the simulator) every phase is a host clock interval. On CUDA the host only
queues forward and sample, so those two are CUDA events, read once the step's own device-to-host
copy of the sampled tokens has synchronized (`synced`): timing adds no synchronization. There,
prepare is host time and write-back is the host time after that copy.
"""

from __future__ import annotations

import time
from typing import Any

PHASES = ("prepare", "forward", "sample", "write_back")
_DEVICE_PHASES = ("forward", "sample")


class StepTimer:
    def __init__(self, cuda: bool = False) -> None:
        self.seconds: dict[str, float] = {}  # the last step's phases
        self.cuda_graph: bool | None = None  # the last forward replayed a CUDA graph (None: n/a)
        self._last = 0.0
        self._events: dict[str, Any] = {}
        if cuda:
            import torch

            self._events = {
                p: torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                for p in ("prepare", *_DEVICE_PHASES)
            }

    def begin(self) -> None:
        self.seconds = {}
        self.cuda_graph = None
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """`phase` ended now (on the device: when the work queued so far is done)."""
        event = self._events.get(phase)
        if event is not None:
            event.record()
        if phase in _DEVICE_PHASES and self._events:
            return
        now = time.perf_counter()
        self.seconds[phase] = now - self._last
        self._last = now

    def synced(self) -> None:
        """The step's device work is done (its device-to-host copy returned): read the events."""
        if not self._events:
            return
        e = self._events
        self.seconds["forward"] = e["prepare"].elapsed_time(e["forward"]) / 1000
        self.seconds["sample"] = e["forward"].elapsed_time(e["sample"]) / 1000
        self._last = time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        """Time spent in `phase` outside the marks (the simulator's device time)."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
