"""Executes the KV moves a plan carries: its copies (device -> host, host -> disk) in order
before the forward pass, then its loads into the device pool on a loader thread while the
forward pass runs (their blocks belong to no request of the plan). On CUDA, copies run on the
current stream (so the forward's later writes follow them) and loads on a side stream that
starts after the copies; the step waits for its loads before it reports them."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from services.worker.kv_tiers.blocks import (
    block_nbytes,
    block_shape,
    copy_payload,
    gather_blocks,
    scatter_blocks,
)
from services.worker.kv_tiers.disk_tier import DiskTier
from services.worker.kv_tiers.host_pool import HostPool
from services.worker.kv_tiers.slots import check_range
from services.worker.kv_tiers.source import TierBlockSource
from services.worker.kv_tiers.stats import (
    FAIL_CHECKSUM,
    FAIL_IO,
    FAIL_TRANSFER,
    KV_REMOTE,
    KVTierStats,
)
from services.worker.kv_transfer import KVIntegrityError, TcpTransport
from shared.wire import KV_DEVICE, KV_DISK, KV_HOST, KVCopy, KVLoad, ModelRunnerOutput

log = logging.getLogger("skiff.worker.kv")
FETCH_GROUP = 32  # fetched blocks written to the device pool at once


@dataclass
class LoadReport:
    """The outcome of one plan's loads."""

    done: list[int] = field(default_factory=list)  # load ids
    failed: list[int] = field(default_factory=list)
    num_bytes: int = 0
    seconds: float = 0.0


class PendingLoads:
    """A plan's loads in progress."""

    def __init__(self, future: Future[LoadReport] | None) -> None:
        self._future = future

    def wait(self) -> LoadReport:
        return LoadReport() if self._future is None else self._future.result()


class KVTierExecutor:
    """The device pool's `kv_caches` (one [2, num_blocks, block_size, kv_heads, head_dim]
    tensor per layer) with its lower tiers (`host`, `disk`: None when off)."""

    transfer_address = ""  # the KV-transfer server's, which serves `block_source()`

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        host: HostPool | None,
        disk: DiskTier | None,
        stats: KVTierStats,
    ) -> None:
        self.kv_caches, self.host, self.disk, self.stats = kv_caches, host, disk, stats
        self.device = kv_caches[0].device
        self.block_shape = block_shape(kv_caches)
        self.block_bytes = block_nbytes(kv_caches)
        self._cuda = self.device.type == "cuda"
        self._side: torch.cuda.Stream | None = None  # the loads' stream (CUDA)
        if self._cuda:
            self._side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-loader")
        self._transport: TcpTransport | None = None

    @property
    def transport(self) -> TcpTransport:
        if self._transport is None:
            self._transport = TcpTransport()
        return self._transport

    def block_source(self) -> TierBlockSource:
        """What the KV-transfer server serves: these tiers."""
        return TierBlockSource(self)

    def begin(self, copies: list[KVCopy], loads: list[KVLoad]) -> PendingLoads:
        """Run `copies` in order, then start `loads` (on the loader thread)."""
        for copy in copies:
            self._copy(copy)
        if not loads:
            return PendingLoads(None)
        after: torch.cuda.Event | None = None
        if self._cuda:
            after = torch.cuda.Event()  # type: ignore[no-untyped-call]
            # the copies before it, not the forward pass enqueued later
            after.record(torch.cuda.current_stream(self.device))
        return PendingLoads(self._loader.submit(self._run_loads, loads, after))

    def report(self, loads: LoadReport, output: ModelRunnerOutput) -> None:
        """Put the plan's load results and the slots lost since the last step in `output`."""
        output.kv_loads_done, output.kv_loads_failed = loads.done, loads.failed
        output.kv_load_bytes, output.kv_load_s = loads.num_bytes, loads.seconds
        lost = self.disk.take_lost() if self.disk is not None else []
        output.kv_lost = {KV_DISK: lost} if lost else {}

    def close(self) -> None:
        """Stop the loader and delete the disk tier's file."""
        self._loader.shutdown(wait=True)
        if self._transport is not None:
            self._transport.close()
        if self.disk is not None:
            self.disk.close()

    # ---- copies -----------------------------------------------------------------------------

    def _copy(self, copy: KVCopy) -> None:
        if len(copy.src) != len(copy.dst):
            raise ValueError(f"KV copy of {len(copy.src)} blocks to {len(copy.dst)} slots")
        route = (copy.src_tier, copy.dst_tier)
        if route == (KV_DEVICE, KV_HOST):
            host = self._tier(KV_HOST, copy.dst)
            assert isinstance(host, HostPool)
            ids = self._device_ids(copy.src)
            host.store(gather_blocks(self.kv_caches, ids), copy.dst)
            self.stats.add(self.stats.offload_bytes, KV_HOST, len(copy.dst) * self.block_bytes)
        elif route == (KV_HOST, KV_DISK):
            host = self._tier(KV_HOST, copy.src)
            disk = self._tier(KV_DISK, copy.dst)
            assert isinstance(host, HostPool) and isinstance(disk, DiskTier)
            # a snapshot now: a later copy of this plan may overwrite the host slot
            for slot, block in zip(copy.dst, host.snapshot(copy.src), strict=True):
                disk.write(slot, block)
        else:
            raise ValueError(f"no KV copy from {copy.src_tier} to {copy.dst_tier}")

    def _tier(self, tier: str, slots: list[int]) -> HostPool | DiskTier:
        """The lower `tier`, checking that it is on and has `slots`."""
        pool = self.host if tier == KV_HOST else self.disk if tier == KV_DISK else None
        if pool is None:
            raise ValueError(f"KV tier {tier!r} is off")
        check_range(tier, slots, pool.num_slots)
        return pool

    def _device_ids(self, block_ids: list[int]) -> torch.Tensor:
        """[n] int64 on the device (checked first: a bad index on CUDA is a device fault)."""
        check_range(KV_DEVICE, block_ids, self.kv_caches[0].shape[1])
        return torch.tensor(block_ids, dtype=torch.int64, device=self.device)

    # ---- loads (on the loader thread) -------------------------------------------------------

    def _run_loads(self, loads: list[KVLoad], after: torch.cuda.Event | None) -> LoadReport:
        start = time.perf_counter()
        report = LoadReport()
        with torch.inference_mode(), self._load_stream(after):
            for load in loads:
                try:
                    report.num_bytes += self._load(load)
                except Exception as exc:  # one load fails, the others and the step go on
                    report.failed.append(load.load_id)
                    self._load_failed(load, exc)
                else:
                    report.done.append(load.load_id)
            if self._side is not None:
                self._side.synchronize()
        report.seconds = time.perf_counter() - start
        return report

    @contextlib.contextmanager
    def _load_stream(self, after: torch.cuda.Event | None) -> Iterator[None]:
        """On CUDA, the side stream as this thread's current one, after the plan's copies."""
        if self._side is None:
            yield
            return
        with torch.cuda.stream(self._side):
            if after is not None:
                self._side.wait_event(after)
            yield

    def _load(self, load: KVLoad) -> int:
        """Fill the load's device blocks; returns the bytes moved."""
        if len(load.src) != len(load.block_ids):
            raise ValueError(f"{len(load.src)} source blocks for {len(load.block_ids)} blocks")
        ids = self._device_ids(load.block_ids)
        num_bytes = len(load.block_ids) * self.block_bytes
        start = time.perf_counter()
        if load.remote_address:
            self._fetch(load, ids)
            source = KV_REMOTE
        elif load.src_tier == KV_HOST:
            host = self._tier(KV_HOST, load.src)
            assert isinstance(host, HostPool)
            scatter_blocks(self.kv_caches, ids, host.to_device(load.src))
            source = KV_HOST
        elif load.src_tier == KV_DISK:
            disk = self._tier(KV_DISK, load.src)
            assert isinstance(disk, DiskTier)
            for i, slot in enumerate(load.src):
                self._put_block(ids[i : i + 1], disk.read(slot))
            source = KV_DISK
        else:
            raise ValueError(f"no local load from tier {load.src_tier!r}")
        self.stats.add(self.stats.load_bytes, source, num_bytes)
        self.stats.add_seconds(source, time.perf_counter() - start)
        return num_bytes

    def _fetch(self, load: KVLoad, ids: torch.Tensor) -> None:
        """The load's blocks from another worker, staged on the host as they arrive and
        written to their device blocks FETCH_GROUP at a time (a copy per layer and group, not
        per block)."""
        staging = torch.empty((len(ids), *self.block_shape), dtype=self.kv_caches[0].dtype)

        def out(i: int, data: memoryview) -> None:
            if len(data) != self.block_bytes:
                raise ValueError(f"a block of {len(data)} bytes, expected {self.block_bytes}")
            copy_payload(staging[i], data)
            if (i + 1) % FETCH_GROUP == 0 or i + 1 == len(ids):
                start = i - (i % FETCH_GROUP)
                group = staging[start : i + 1].to(self.device)
                scatter_blocks(self.kv_caches, ids[start : i + 1], group)

        self.transport.fetch(
            load.remote_address,
            load.remote_instance_id,
            load.src_tier,
            load.src,
            self.block_bytes,
            out,
        )

    def _put_block(self, block_id: torch.Tensor, data: memoryview | bytes) -> None:
        """Write one block's payload to device block `block_id` ([1] int64 on the device)."""
        if len(data) != self.block_bytes:
            raise ValueError(f"a block of {len(data)} bytes, expected {self.block_bytes}")
        staging = torch.empty((1, *self.block_shape), dtype=self.kv_caches[0].dtype)
        copy_payload(staging, data)
        scatter_blocks(self.kv_caches, block_id, staging.to(self.device))

    def _load_failed(self, load: KVLoad, exc: Exception) -> None:
        if isinstance(exc, KVIntegrityError):
            reason = FAIL_CHECKSUM
        elif load.remote_address:
            reason = FAIL_TRANSFER
        else:
            reason = FAIL_IO
        self.stats.add(self.stats.load_failures, reason)
        where = load.remote_address or "this worker"
        log.warning(
            "KV load %d (%d blocks from %s of %s) failed: %s: %s",
            load.load_id,
            len(load.block_ids),
            load.src_tier,
            where,
            type(exc).__name__,
            exc,
        )
