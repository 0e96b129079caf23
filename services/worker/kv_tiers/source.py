"""What this worker serves to others over the KV-transfer path: copies of its device blocks,
host slots and (checksum-verified) disk slots, read on the transfer server's threads."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from services.worker.kv_tiers.blocks import gather_blocks, payload
from services.worker.kv_tiers.slots import check_range
from shared.wire import KV_DEVICE, KV_DISK, KV_HOST

if TYPE_CHECKING:
    from services.worker.kv_tiers.executor import KVTierExecutor

GATHER_GROUP = 32  # device blocks copied out at once for a fetch


class TierBlockSource:
    """A BlockSource over one runner's tiers. LookupError: no such tier or block (IndexError
    is one)."""

    def __init__(self, tiers: KVTierExecutor) -> None:
        self.tiers = tiers

    def read_blocks(self, tier: str, indices: list[int]) -> Iterator[memoryview | bytes]:
        """One payload per index, [num_layers, 2, block_size, kv_heads, head_dim] each."""
        t = self.tiers
        if tier == KV_DISK and t.disk is not None:
            disk = t.disk
            check_range(tier, indices, disk.num_slots)
            return (disk.read(slot) for slot in indices)
        if tier == KV_HOST and t.host is not None:
            check_range(tier, indices, t.host.num_slots)
            return _payloads(t.host.snapshot(indices))
        if tier == KV_DEVICE:
            check_range(tier, indices, t.kv_caches[0].shape[1])
            return _device_payloads(t.kv_caches, indices, t.device)
        raise LookupError(f"KV tier {tier!r}: none here")


def _device_payloads(
    kv_caches: list[torch.Tensor], indices: list[int], device: torch.device
) -> Iterator[memoryview]:
    """Device blocks copied to the host GATHER_GROUP at a time, as they are sent: the first
    bytes leave while the rest is gathered."""
    for start in range(0, len(indices), GATHER_GROUP):
        with torch.inference_mode():
            ids = torch.tensor(indices[start : start + GATHER_GROUP], device=device)
            yield from _payloads(gather_blocks(kv_caches, ids).cpu())


def _payloads(blocks: torch.Tensor) -> Iterator[memoryview]:
    """[n, *block_shape] on the host -> n payloads (views that keep `blocks`)."""
    return (payload(block) for block in blocks)
