"""The local-disk KV tier: one preallocated file of fixed slots, owned by this process
(recreated at start, deleted at stop). Writes run on a writer thread in the order they were
given; a read of a slot waits for its pending writes and verifies the slot's checksum, kept in
memory. A slot whose write failed, or whose read did not verify, is lost until written again:
`take_lost` reports each such slot once."""

from __future__ import annotations

import logging
import os
import queue
import threading
from pathlib import Path

import torch

from services.worker.kv_tiers.blocks import payload
from services.worker.kv_tiers.stats import KVTierStats
from services.worker.kv_transfer import KVIntegrityError, checksum
from shared.wire import KV_DISK

log = logging.getLogger("skiff.worker.kv")


class DiskTier:
    """`num_slots` slots of `block_bytes` in the file at `path` (open it with `open`)."""

    def __init__(self, path: Path, fd: int, num_slots: int, block_bytes: int, stats: KVTierStats):
        self.path, self._fd = path, fd
        self.num_slots, self.block_bytes = num_slots, block_bytes
        self._stats = stats
        self._checksums: dict[int, int] = {}  # slot -> checksum of the block written there
        self._lost: set[int] = set()
        self._pending: dict[int, int] = {}  # slot -> writes queued or running
        self._cond = threading.Condition()
        self._writes: queue.Queue[tuple[int, torch.Tensor] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    @classmethod
    def open(
        cls, directory: str, name: str, num_slots: int, block_bytes: int, stats: KVTierStats
    ) -> DiskTier | None:
        """The tier in a new file `name` under `directory` (created if missing), its space
        allocated up front; None when that fails (the tier is off: logged and counted)."""
        path = Path(directory) / name
        fd = -1
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.posix_fallocate(fd, 0, num_slots * block_bytes)
        except OSError as exc:
            log.error(
                "KV disk tier off: cannot allocate %d bytes at %s: %s",
                num_slots * block_bytes,
                path,
                exc,
            )
            stats.add(stats.disk_errors, "setup")
            if fd >= 0:
                os.close(fd)
                path.unlink(missing_ok=True)
            return None
        return cls(path, fd, num_slots, block_bytes, stats)

    def write(self, slot: int, block: torch.Tensor) -> None:
        """Write `block` (a contiguous CPU tensor of one block that nothing else writes) to
        `slot`, asynchronously."""
        with self._cond:
            self._pending[slot] = self._pending.get(slot, 0) + 1
        self._writes.put((slot, block))

    def read(self, slot: int) -> bytes:
        """The block in `slot`, verified, once its pending writes are done. LookupError: the
        slot holds no block; KVIntegrityError: its content does not match its checksum;
        OSError: the read failed (either way the slot is lost)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._pending.get(slot))
            expected = self._checksums.get(slot)
        if expected is None:
            raise LookupError(f"disk slot {slot} holds no block")
        try:
            data = os.pread(self._fd, self.block_bytes, slot * self.block_bytes)
            if len(data) != self.block_bytes:
                raise OSError(f"short read of disk slot {slot}: {len(data)} bytes")
        except OSError:
            self._fail(slot, "read")
            raise
        if checksum(data) != expected:
            self._fail(slot, "read")
            raise KVIntegrityError(f"disk slot {slot}: checksum mismatch")
        return data

    def take_lost(self) -> list[int]:
        """Slots lost since the last call."""
        with self._cond:
            lost, self._lost = sorted(self._lost), set()
        return lost

    def close(self) -> None:
        """Stop the writer (dropping writes not yet started) and delete the file."""
        while True:
            try:
                self._writes.get_nowait()
            except queue.Empty:
                break
        self._writes.put(None)
        self._writer.join()
        with self._cond:  # the writes dropped above
            self._pending.clear()
            self._cond.notify_all()
        os.close(self._fd)
        self.path.unlink(missing_ok=True)

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            slot, block = item
            data = payload(block)
            try:
                offset, written = slot * self.block_bytes, 0
                while written < len(data):
                    n = os.pwrite(self._fd, data[written:], offset + written)
                    if n == 0:
                        raise OSError(f"no progress writing disk slot {slot}")
                    written += n
            except OSError as exc:
                log.warning("KV disk tier: writing slot %d failed: %s", slot, exc)
                self._fail(slot, "write")
            else:
                with self._cond:
                    self._checksums[slot] = checksum(data)
                    self._lost.discard(slot)
                self._stats.add(self._stats.offload_bytes, KV_DISK, len(data))
            with self._cond:
                self._pending[slot] -= 1
                self._cond.notify_all()

    def _fail(self, slot: int, op: str) -> None:
        """`slot` lost after a failed `op`."""
        self._stats.add(self._stats.disk_errors, op)
        with self._cond:
            self._checksums.pop(slot, None)
            self._lost.add(slot)
