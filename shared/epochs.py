"""Scheduler epochs: which scheduler of a shard workers and gateways follow.

An epoch is new on every scheduler start and sorts by its start time (16 hex digits of
nanoseconds, then random ones). Two schedulers on one shard (a zombie, a rollout overlap) must
not take turns: a message of another epoch replaces the current one only when that epoch is
newer, or when the current one has gone silent (a scheduler restarted on a host whose clock is
behind). Everything else from another epoch is ignored.
"""

from __future__ import annotations

import time
import uuid

# A worker follows an older epoch's plans once the current epoch sent none for this long.
STALE_EPOCH_SILENCE_S = 10.0


def new_epoch() -> str:
    """An epoch that sorts after every epoch started earlier (on a synchronised clock)."""
    return f"{time.time_ns():016x}{uuid.uuid4().hex[:16]}"


def supersedes(epoch: str, current: str | None, *, current_silent: bool) -> bool:
    """Whether a message of `epoch` may replace the `current` epoch (None: none yet)."""
    return current is None or epoch == current or epoch > current or current_silent


class EpochFollower:
    """The epoch a worker follows, from the plans it receives: a plan of another epoch is
    taken only when `supersedes` allows it; the current epoch is silent after `silence_s`
    without a plan."""

    def __init__(self, silence_s: float) -> None:
        self.silence_s = silence_s
        self.current: str | None = None
        self._last_seen = float("-inf")  # time.monotonic()

    def follow(self, epoch: str) -> bool:
        """Whether to act on a message of `epoch` (which then becomes or stays current)."""
        now = time.monotonic()
        silent = now - self._last_seen >= self.silence_s
        if not supersedes(epoch, self.current, current_silent=silent):
            return False
        self.current, self._last_seen = epoch, now
        return True

    def heard(self, epoch: str) -> None:
        """A heartbeat of a scheduler: the current epoch is alive even while it sends no plans
        (an idle worker must not take a zombie's plans for a successor's)."""
        if epoch == self.current:
            self._last_seen = time.monotonic()
