"""Prefill/decode disaggregation: a long prompt is prefilled on a prefill worker, which samples
and streams its first token; the request then moves to a decode worker, which fetches the
prompt's KV blocks from the prefill worker over the KV-transfer path (`kv_loads.py`, the way
it fetches any block another worker holds) and decodes. The scheduler owns both block pools,
so it plans the whole hand-over itself: which decode worker, which blocks, when.

The prefill worker holds the prompt's blocks until the request lands on its decode worker
(admitted there, its KV in place) or ends, so that they cannot be evicted while they are
fetched. A fetch that fails (prefill worker gone, checksum mismatch) leaves the decode worker
to compute what it lacks, as after a migration.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

# How a hand-over ended: the decode worker loaded prompt blocks from the prefill worker,
# computed the prompt itself (its fetch failed or found nothing), or there was no decode worker
# to hand over to (the request decodes on its prefill worker).
TRANSFERRED, RECOMPUTED, LOCAL = "transferred", "recomputed", "local"
OUTCOMES = (TRANSFERRED, RECOMPUTED, LOCAL)


@dataclass
class Handoff:
    """A request on its way from the prefill worker `source_id` to a decode worker.
    `release_source` frees its blocks on the prefill worker; `on_landed(handoff,
    num_loaded_bytes)` is told once it runs on the decode worker."""

    source_id: str
    release_source: Callable[[], None]
    on_landed: Callable[[Handoff, int], None]
    local: bool = False  # no decode worker took it: it decodes where it was prefilled
    started_at: float = field(default_factory=time.monotonic)
    num_hits_at_fetch: int = -1  # its device hits when its last fetch was planned
    done: bool = False

    def outcome(self, num_loaded_bytes: int) -> str:
        if self.local:
            return LOCAL
        return TRANSFERRED if num_loaded_bytes else RECOMPUTED

    def land(self, num_loaded_bytes: int) -> None:
        """Admitted on the decode worker with `num_loaded_bytes` of KV fetched."""
        if not self.done:
            self.done = True
            self.release_source()
            self.on_landed(self, num_loaded_bytes)

    def drop(self) -> None:
        """Ended (finished, aborted, moved on) before it landed."""
        if not self.done:
            self.done = True
            self.release_source()
