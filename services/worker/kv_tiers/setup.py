"""The lower tiers a runner's settings ask for, sized in whole blocks."""

from __future__ import annotations

import logging
import re

import torch

from services.worker.config import RunnerConfig
from services.worker.kv_tiers.blocks import block_nbytes, block_shape
from services.worker.kv_tiers.disk_tier import DiskTier
from services.worker.kv_tiers.executor import KVTierExecutor
from services.worker.kv_tiers.host_pool import HostPool
from services.worker.kv_tiers.slots import num_tier_blocks
from services.worker.kv_tiers.stats import KVTierStats

log = logging.getLogger("skiff.worker.kv")


def disk_file_name(worker_id: str) -> str:
    """The disk tier's file of a worker: one per worker id, so that a restarted worker
    recreates its predecessor's file instead of leaving it behind."""
    return "skiff-kv-" + re.sub(r"[^A-Za-z0-9_.-]", "_", worker_id) + ".bin"


def build_kv_tiers(
    kv_caches: list[torch.Tensor], config: RunnerConfig, worker_id: str
) -> KVTierExecutor:
    """The executor of the device pool `kv_caches` with the host and disk tiers of `config`
    (a disk tier that cannot be set up is off)."""
    block_bytes = block_nbytes(kv_caches)
    stats = KVTierStats(num_device_blocks=kv_caches[0].shape[1], block_bytes=block_bytes)
    host = disk = None
    num_host = num_tier_blocks(config.kv_offloading_size, block_bytes)
    if num_host:
        shape, dtype, device = block_shape(kv_caches), kv_caches[0].dtype, kv_caches[0].device
        host = HostPool(num_host, shape, dtype, device)
        stats.num_host_blocks = num_host
        num_disk = num_tier_blocks(config.kv_offloading_disk_size, block_bytes)
        if num_disk:
            path, name = config.kv_offloading_disk_path, disk_file_name(worker_id)
            disk = DiskTier.open(path, name, num_disk, block_bytes, stats)
            stats.num_disk_blocks = num_disk if disk is not None else 0
    elif config.kv_offloading_size:
        log.warning("KV host tier off: %s GiB holds no block", config.kv_offloading_size)
    if host is not None:
        log.info(
            "KV tiers: %d host blocks, %d disk blocks of %d bytes",
            stats.num_host_blocks,
            stats.num_disk_blocks,
            block_bytes,
        )
    return KVTierExecutor(kv_caches, host, disk, stats)
