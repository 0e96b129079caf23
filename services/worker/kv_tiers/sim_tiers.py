"""A simulated worker's KV tiers (`--device sim`): the sizes its settings ask for, copies that
move nothing, loads that take the time the modelled bandwidth gives them."""

from __future__ import annotations

from services.worker.kv_tiers.slots import check_range, num_tier_blocks
from services.worker.kv_tiers.stats import FAIL_IO, FAIL_TRANSFER, KV_REMOTE, KVTierStats
from shared.wire import KV_DEVICE, KV_DISK, KV_HOST, KVCopy, KVLoad, ModelRunnerOutput

# Llama-3-8B stores K and V for 32 layers x 8 KV heads x 128 dims in bf16: 128 KiB per token.
SIM_KV_BYTES_PER_TOKEN = 128 * 2**10
# What simulated workers advertise as their KV-transfer address: no server is behind it, a fetch
# from another simulated worker takes the modelled time like a load from a lower tier.
SIM_TRANSFER_ADDRESS = "sim"


class SimKVTiers:
    """The tiers of a simulated device pool of `num_blocks` blocks of `block_size` tokens."""

    transfer_address = SIM_TRANSFER_ADDRESS

    def __init__(
        self, num_blocks: int, block_size: int, host_gib: float, disk_gib: float, load_gbps: float
    ) -> None:
        block_bytes = SIM_KV_BYTES_PER_TOKEN * block_size
        num_host = num_tier_blocks(host_gib, block_bytes)
        num_disk = num_tier_blocks(disk_gib, block_bytes) if num_host else 0
        self.stats = KVTierStats(num_blocks, num_host, num_disk, block_bytes)
        self.load_gbps = load_gbps

    def block_source(self) -> None:
        """Nothing to serve: no KV is kept."""
        return None

    def copy(self, copies: list[KVCopy]) -> None:
        """Check and count the copies (ValueError, IndexError: the plan is wrong)."""
        sizes, block_bytes = self.stats.capacity(), self.stats.block_bytes
        for c in copies:
            if (c.src_tier, c.dst_tier) not in ((KV_DEVICE, KV_HOST), (KV_HOST, KV_DISK)):
                raise ValueError(f"no KV copy from {c.src_tier} to {c.dst_tier}")
            if len(c.src) != len(c.dst) or not sizes[c.dst_tier]:
                raise ValueError(f"KV copy of {len(c.src)} blocks to {c.dst_tier}: {c.dst}")
            check_range(c.src_tier, c.src, sizes[c.src_tier])
            check_range(c.dst_tier, c.dst, sizes[c.dst_tier])
            self.stats.add(self.stats.offload_bytes, c.dst_tier, len(c.dst) * block_bytes)

    def load(self, loads: list[KVLoad], output: ModelRunnerOutput) -> float:
        """Report the loads in `output` (a load with bad indices fails, as a real one would);
        returns the time they take at the modelled bandwidth."""
        for load in loads:
            source = KV_REMOTE if load.remote_address else load.src_tier
            if not self._valid(load):
                output.kv_loads_failed.append(load.load_id)
                reason = FAIL_TRANSFER if load.remote_address else FAIL_IO
                self.stats.add(self.stats.load_failures, reason)
                continue
            output.kv_loads_done.append(load.load_id)
            num_bytes = len(load.block_ids) * self.stats.block_bytes
            output.kv_load_bytes += num_bytes
            self.stats.add(self.stats.load_bytes, source, num_bytes)
            self.stats.add_seconds(source, num_bytes / (self.load_gbps * 1e9))
        output.kv_load_s = output.kv_load_bytes / (self.load_gbps * 1e9)
        return output.kv_load_s

    def _valid(self, load: KVLoad) -> bool:
        """What a real worker could load: as many sources as blocks, in range (a remote
        source's range is the remote worker's to check)."""
        sizes = self.stats.capacity()
        if len(load.src) != len(load.block_ids):
            return False
        if not all(0 <= b < sizes[KV_DEVICE] for b in load.block_ids):
            return False
        if load.remote_address:
            return True
        tier_size = sizes[load.src_tier] if load.src_tier in (KV_HOST, KV_DISK) else 0
        return all(0 <= i < tier_size for i in load.src)
