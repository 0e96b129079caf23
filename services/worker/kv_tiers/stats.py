"""What a worker's KV tiers hold and what they have moved: read by the metrics at each scrape,
written by the step's, the loader's and the disk writer's threads."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from shared.wire import KV_DEVICE, KV_DISK, KV_HOST

KV_REMOTE = "remote"  # a load's source: another worker's tier
# Why a load failed: its data did not verify, a local read failed, a remote fetch failed
FAIL_CHECKSUM, FAIL_IO, FAIL_TRANSFER = "checksum", "io", "transfer"
LOAD_SOURCES = (KV_HOST, KV_DISK, KV_REMOTE)
LOAD_FAILURES = (FAIL_CHECKSUM, FAIL_IO, FAIL_TRANSFER)
DISK_OPS = ("setup", "write", "read")


@dataclass
class KVTierStats:
    """The tiers' capacity in blocks (0: off) and cumulative counters, by label."""

    num_device_blocks: int
    num_host_blocks: int = 0
    num_disk_blocks: int = 0
    block_bytes: int = 0  # one block of every layer, K and V
    offload_bytes: Counter[str] = field(default_factory=Counter)  # by destination tier
    load_bytes: Counter[str] = field(default_factory=Counter)  # by source (LOAD_SOURCES)
    load_seconds: dict[str, float] = field(default_factory=dict)  # by source: loader's time
    load_failures: Counter[str] = field(default_factory=Counter)  # by reason (LOAD_FAILURES)
    disk_errors: Counter[str] = field(default_factory=Counter)  # by op (DISK_OPS)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, counter: Counter[str], label: str, amount: int = 1) -> None:
        with self._lock:
            counter[label] += amount

    def add_seconds(self, source: str, seconds: float) -> None:
        with self._lock:
            self.load_seconds[source] = self.load_seconds.get(source, 0.0) + seconds

    def read_seconds(self) -> dict[str, float]:
        with self._lock:
            return dict(self.load_seconds)

    def read(self, counter: Counter[str]) -> dict[str, int]:
        with self._lock:
            return dict(counter)

    def capacity(self) -> dict[str, int]:
        """Blocks per tier."""
        return {
            KV_DEVICE: self.num_device_blocks,
            KV_HOST: self.num_host_blocks,
            KV_DISK: self.num_disk_blocks,
        }
