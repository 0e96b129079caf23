"""A worker's lower KV tiers as its scheduling core sees them.

Below the device pool each worker may have a host-memory tier and a local-disk tier, made of
fixed slots of one block each. The scheduling core decides what goes where and the plan tells
the worker (`BatchPlan.kv_copies`), so the index here is exact, not a guess from events:

- a prefix block whose last user frees it is written down to the host tier (write-through: the
  copy rides in the next plan and runs before that plan's forward pass, which may already reuse
  the device block), unless the host tier has its hash already;
- a host slot taken for a new block first spills its old block to the disk tier, when there is
  one; the disk tier drops its least recently used block;
- a slot being read (a load, or another worker's fetch) is pinned and never reused until the
  read is over.

Each slot remembers the plan step that writes it (`ready_step`): another worker may fetch it
only once that step's result came back, so it never reads a slot before it was written.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from shared.wire import KV_DEVICE, KV_DISK, KV_HOST, KVCopy


@dataclass
class TierSlot:
    """One slot of a lower tier holding the block with `block_hash`."""

    block_hash: bytes
    slot: int
    ready_step: int  # the plan whose copies write it
    pins: int = 0  # reads in progress


class TierIndex:
    """The slots of one lower tier: hash -> slot, least recently used first."""

    def __init__(self, tier: str, num_slots: int) -> None:
        self.tier = tier
        self.num_slots = num_slots
        self._slots: OrderedDict[bytes, TierSlot] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))  # pop() takes the lowest first

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def hashes(self) -> Iterator[bytes]:
        return iter(self._slots)

    def get(self, block_hash: bytes) -> TierSlot | None:
        return self._slots.get(block_hash)

    def touch(self, entry: TierSlot) -> None:
        """Mark as most recently used."""
        self._slots.move_to_end(entry.block_hash)

    def insert(self, block_hash: bytes, step: int) -> tuple[TierSlot, TierSlot | None] | None:
        """A slot for a new block, written by plan `step`: a free one, else the least recently
        used unpinned one, whose entry is returned as evicted. None: every slot is pinned."""
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            evicted = next((e for e in self._slots.values() if not e.pins), None)
            if evicted is None:
                return None
            del self._slots[evicted.block_hash]
            slot = evicted.slot
        entry = self._slots[block_hash] = TierSlot(block_hash, slot, step)
        return entry, evicted

    def drop_slots(self, slots: list[int]) -> int:
        """Forget the blocks of `slots` (their content is lost); returns how many were held."""
        lost = set(slots)
        gone = [e for e in self._slots.values() if e.slot in lost]
        for entry in gone:
            del self._slots[entry.block_hash]
            if not entry.pins:  # a pinned slot returns when its read ends
                self._free.append(entry.slot)
            else:
                entry.block_hash = b""
        return len(gone)

    def unpin(self, entry: TierSlot) -> None:
        entry.pins -= 1
        if not entry.pins and not entry.block_hash:  # dropped while pinned
            self._free.append(entry.slot)


class LowerTiers:
    """The host and disk tiers of one worker and the copies the next plan must carry."""

    def __init__(self, num_host_blocks: int, num_disk_blocks: int) -> None:
        self.host = TierIndex(KV_HOST, num_host_blocks)
        self.disk = TierIndex(KV_DISK, num_disk_blocks if num_host_blocks else 0)
        self._copies: list[KVCopy] = []

    @property
    def enabled(self) -> bool:
        return self.host.num_slots > 0

    def tier(self, name: str) -> TierIndex:
        return self.host if name == KV_HOST else self.disk

    def lookup(self, block_hash: bytes) -> TierSlot | None:
        """The slot holding the block, host tier first."""
        return self.host.get(block_hash) or self.disk.get(block_hash)

    def tier_of(self, entry: TierSlot) -> str:
        return KV_HOST if self.host.get(entry.block_hash) is entry else KV_DISK

    def hashes(self) -> Iterator[bytes]:
        yield from self.host.hashes()
        yield from self.disk.hashes()

    def offload(self, blocks: list[tuple[int, bytes]], step: int) -> None:
        """Write freed prefix blocks, (block id, hash), down to the host tier in plan `step`."""
        for block_id, block_hash in blocks:
            held = self.host.get(block_hash)
            if held is not None:
                self.host.touch(held)
                continue
            taken = self.host.insert(block_hash, step)
            if taken is None:
                return  # every host slot is being read
            entry, evicted = taken
            if evicted is not None:
                self._spill(evicted, step)
            self._copy(KV_DEVICE, KV_HOST, block_id, entry.slot)

    def _spill(self, evicted: TierSlot, step: int) -> None:
        """Keep a block leaving the host tier on disk (before its slot is overwritten)."""
        if not self.disk.num_slots:
            return
        held = self.disk.get(evicted.block_hash)
        if held is not None:
            self.disk.touch(held)
            return
        taken = self.disk.insert(evicted.block_hash, step)
        if taken is not None:
            self._copy(KV_HOST, KV_DISK, evicted.slot, taken[0].slot)

    def _copy(self, src_tier: str, dst_tier: str, src: int, dst: int) -> None:
        last = self._copies[-1] if self._copies else None
        same_kind = last is not None and (last.src_tier, last.dst_tier) == (src_tier, dst_tier)
        if last is not None and same_kind and dst not in last.dst:  # one write per slot
            last.src.append(src)
            last.dst.append(dst)
        else:
            self._copies.append(KVCopy(src_tier, dst_tier, [src], [dst]))

    def take_copies(self) -> list[KVCopy]:
        """The copies for the plan being built, in the order they must run."""
        copies, self._copies = self._copies, []
        return copies

    def lost(self, tier: str, slots: list[int]) -> int:
        """The worker reports `slots` of `tier` lost; returns how many blocks were dropped."""
        return self.tier(tier).drop_slots(slots) if tier in (KV_HOST, KV_DISK) else 0
