"""The worker's KV tiers on bare KV tensors: copies device -> host -> disk and loads back are
bit-exact and touch exactly their blocks; a spill keeps what its host slot held when the copy
ran; the disk tier detects corruption and failed writes and reports each lost slot once; a disk
tier that cannot be set up is off, not a crash; the transfer source serves every tier."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from services.worker.config import RunnerConfig
from services.worker.kv_tiers import disk_tier
from services.worker.kv_tiers.blocks import block_nbytes, gather_blocks
from services.worker.kv_tiers.executor import KVTierExecutor
from services.worker.kv_tiers.setup import build_kv_tiers, disk_file_name
from services.worker.kv_transfer import KVIntegrityError
from shared.wire import KV_DEVICE, KV_DISK, KV_HOST, KVCopy, KVLoad, ModelRunnerOutput

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 10, 4, 2, 8
HOST_SLOTS, DISK_SLOTS = 6, 5
WORKER = "w-0"


def make_caches(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """One [2, BLOCKS, BS, HEADS, DIM] tensor per layer, random."""
    g = torch.Generator().manual_seed(0)
    shape = (2, BLOCKS, BS, HEADS, DIM)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(LAYERS)]


def gib(blocks: int, caches: list[torch.Tensor]) -> float:
    return blocks * block_nbytes(caches) / 2**30


def tiers(caches: list[torch.Tensor], disk_path: Path | str, **config: float) -> KVTierExecutor:
    settings: dict[str, float | str] = {
        "kv_offloading_size": gib(HOST_SLOTS, caches),
        "kv_offloading_disk_size": gib(DISK_SLOTS, caches),
        "kv_offloading_disk_path": str(disk_path),
        **config,
    }
    return build_kv_tiers(caches, RunnerConfig(model_dir="unused", **settings), WORKER)


@pytest.fixture
def kv(tmp_path):
    caches = make_caches()
    executor = tiers(caches, tmp_path)
    yield caches, executor
    executor.close()


def step(ex: KVTierExecutor, copies=(), loads=()) -> ModelRunnerOutput:
    """A plan's KV moves, as the runner runs them around its forward pass."""
    pending = ex.begin(list(copies), list(loads))
    out = ModelRunnerOutput(step_id=0)
    ex.report(pending.wait(), out)
    return out


def blocks(caches: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    """[n, LAYERS, 2, BS, HEADS, DIM] copy of device blocks `ids`."""
    return gather_blocks(caches, torch.tensor(ids))


def load(load_id: int, block_ids: list[int], tier: str, src: list[int], **kw: str) -> KVLoad:
    return KVLoad(load_id=load_id, block_ids=block_ids, src_tier=tier, src=src, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_device_host_disk_device_round_trip_is_bit_exact(tmp_path, dtype):
    caches = make_caches(dtype)
    ex = tiers(caches, tmp_path)
    try:
        original = blocks(caches, [1, 2, 3])
        out = step(
            ex,
            copies=[
                KVCopy(KV_DEVICE, KV_HOST, [1, 2, 3], [0, 4, 1]),
                KVCopy(KV_HOST, KV_DISK, [0, 4, 1], [3, 0, 4]),
            ],
        )
        assert out.kv_lost == {} and out.kv_loads_done == []
        for kv in caches:
            kv.zero_()
        out = step(ex, loads=[load(7, [9, 5, 6], KV_DISK, [3, 0, 4]), load(8, [0], KV_HOST, [4])])
        assert out.kv_loads_done == [7, 8] and out.kv_loads_failed == []
        assert out.kv_load_bytes == 4 * ex.block_bytes and out.kv_load_s > 0
        assert torch.equal(blocks(caches, [9, 5, 6]).view(torch.uint8), original.view(torch.uint8))
        assert torch.equal(blocks(caches, [0])[0], original[1])
    finally:
        ex.close()


def test_loads_fill_exactly_their_blocks(kv):
    caches, ex = kv
    step(ex, copies=[KVCopy(KV_DEVICE, KV_HOST, [0, 1, 2], [0, 1, 2])])
    step(ex, copies=[KVCopy(KV_HOST, KV_DISK, [1], [2])])
    want = [kv.clone() for kv in caches]
    for w in want:  # host slots 0, 2 -> blocks 7, 4; disk slot 2 (block 1) -> block 8
        w[:, [7, 4, 8]] = w[:, [0, 2, 1]]
    out = step(ex, loads=[load(1, [7, 4], KV_HOST, [0, 2]), load(2, [8], KV_DISK, [2])])
    assert out.kv_loads_done == [1, 2]
    for got, w in zip(caches, want, strict=True):
        assert torch.equal(got, w)
    assert ex.stats.load_bytes == {KV_HOST: 2 * ex.block_bytes, KV_DISK: ex.block_bytes}
    assert ex.stats.offload_bytes == {KV_HOST: 3 * ex.block_bytes, KV_DISK: ex.block_bytes}


def test_a_spill_keeps_the_host_slot_as_it_was_when_the_copy_ran(kv):
    caches, ex = kv
    first, second = blocks(caches, [1])[0], blocks(caches, [2])[0]
    step(ex, copies=[KVCopy(KV_DEVICE, KV_HOST, [1], [0])])
    # One plan: spill host slot 0 to disk, then overwrite host slot 0 with another block
    step(
        ex,
        copies=[
            KVCopy(KV_HOST, KV_DISK, [0], [3]),
            KVCopy(KV_DEVICE, KV_HOST, [2], [0]),
        ],
    )
    out = step(ex, loads=[load(1, [8], KV_DISK, [3]), load(2, [9], KV_HOST, [0])])
    assert out.kv_loads_done == [1, 2]
    assert torch.equal(blocks(caches, [8])[0], first)
    assert torch.equal(blocks(caches, [9])[0], second)


def flip_byte(ex: KVTierExecutor, slot: int) -> None:
    assert ex.disk is not None
    with open(ex.disk.path, "r+b") as f:
        f.seek(slot * ex.block_bytes + 17)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


def test_a_corrupted_disk_slot_fails_its_load_and_is_reported_lost_once(kv, caplog):
    caches, ex = kv
    step(ex, copies=[KVCopy(KV_DEVICE, KV_HOST, [1, 2], [0, 1])])
    step(ex, copies=[KVCopy(KV_HOST, KV_DISK, [0, 1], [2, 3])])
    ex.disk.read(2)  # the write is done before the file is touched
    flip_byte(ex, 2)
    good = blocks(caches, [2])[0]
    with caplog.at_level(logging.WARNING, "skiff.worker.kv"):
        out = step(ex, loads=[load(4, [7], KV_DISK, [2]), load(5, [8], KV_DISK, [3])])
    assert out.kv_loads_failed == [4] and out.kv_loads_done == [5]
    assert out.kv_lost == {KV_DISK: [2]}
    assert torch.equal(blocks(caches, [8])[0], good)
    assert "KV load 4" in caplog.text and "checksum" in caplog.text
    assert ex.stats.load_failures == {"checksum": 1}
    assert ex.stats.disk_errors == {"read": 1}
    assert step(ex).kv_lost == {}  # once
    out = step(ex, loads=[load(6, [7], KV_DISK, [2])])  # lost: nothing to load
    assert out.kv_loads_failed == [6] and out.kv_lost == {}
    step(ex, copies=[KVCopy(KV_HOST, KV_DISK, [0], [2])])  # written again: readable again
    assert step(ex, loads=[load(7, [7], KV_DISK, [2])]).kv_loads_done == [7]


def test_a_failed_disk_write_loses_its_slot(kv, monkeypatch):
    _, ex = kv
    real_pwrite = os.pwrite

    def pwrite(fd: int, data, offset: int) -> int:
        if offset == 4 * ex.block_bytes:
            raise OSError(28, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(disk_tier.os, "pwrite", pwrite)
    step(ex, copies=[KVCopy(KV_DEVICE, KV_HOST, [1, 2], [0, 1])])
    step(ex, copies=[KVCopy(KV_HOST, KV_DISK, [0, 1], [4, 0])])
    out = step(ex, loads=[load(1, [7], KV_DISK, [4]), load(2, [8], KV_DISK, [0])])
    assert out.kv_loads_failed == [1] and out.kv_loads_done == [2]
    assert out.kv_lost == {KV_DISK: [4]}
    assert ex.stats.disk_errors == {"write": 1}
    assert ex.stats.load_failures == {"io": 1}
    assert ex.stats.offload_bytes[KV_DISK] == ex.block_bytes


def test_the_disk_file_is_recreated_at_start_and_deleted_at_close(tmp_path):
    stale = tmp_path / disk_file_name(WORKER)
    stale.write_bytes(b"x" * 100_000)
    caches = make_caches()
    ex = tiers(caches, tmp_path)
    assert ex.disk is not None and ex.disk.path == stale
    assert stale.stat().st_size == DISK_SLOTS * ex.block_bytes
    assert ex.stats.num_disk_blocks == DISK_SLOTS and ex.stats.num_host_blocks == HOST_SLOTS
    ex.close()
    assert not stale.exists()


@pytest.mark.parametrize("case", ["path is a file", "under a file", "disk full"])
def test_a_disk_tier_that_cannot_be_set_up_is_off(tmp_path, caplog, monkeypatch, case):
    caches = make_caches()
    (tmp_path / "file").write_text("")
    path = {"path is a file": tmp_path / "file", "under a file": tmp_path / "file" / "kv"}.get(
        case, tmp_path / "kv"
    )
    if case == "disk full":

        def fallocate(fd: int, offset: int, length: int) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(disk_tier.os, "posix_fallocate", fallocate)
    with caplog.at_level(logging.ERROR, "skiff.worker.kv"):
        ex = tiers(caches, path)
    try:
        assert ex.disk is None and ex.stats.num_disk_blocks == 0
        assert ex.host is not None and ex.stats.num_host_blocks == HOST_SLOTS
        assert ex.stats.disk_errors == {"setup": 1}
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "KV disk tier off" in errors[0].getMessage()
        assert not (tmp_path / "kv" / disk_file_name(WORKER)).exists()
        with pytest.raises(ValueError, match="disk"):  # a plan that spills is wrong now
            step(ex, copies=[KVCopy(KV_HOST, KV_DISK, [0], [0])])
    finally:
        ex.close()


def test_bad_copies_fail_the_plan_and_bad_loads_only_themselves(kv):
    caches, ex = kv
    for copy in (
        KVCopy(KV_DEVICE, KV_HOST, [BLOCKS], [0]),
        KVCopy(KV_DEVICE, KV_HOST, [0], [HOST_SLOTS]),
        KVCopy(KV_DEVICE, KV_DISK, [0], [0]),
        KVCopy(KV_DEVICE, KV_HOST, [0, 1], [0]),
    ):
        with pytest.raises((ValueError, IndexError)):
            step(ex, copies=[copy])
    step(ex, copies=[KVCopy(KV_DEVICE, KV_HOST, [3], [1])])
    out = step(
        ex,
        loads=[
            load(1, [BLOCKS], KV_HOST, [1]),
            load(2, [4], KV_HOST, [HOST_SLOTS]),
            load(3, [4], KV_DEVICE, [3]),
            load(4, [5], KV_HOST, [1]),
        ],
    )
    assert out.kv_loads_failed == [1, 2, 3] and out.kv_loads_done == [4]
    assert torch.equal(blocks(caches, [5]), blocks(caches, [3]))


def test_the_transfer_source_serves_every_tier(kv):
    caches, ex = kv
    source = ex.block_source()
    step(ex, copies=[KVCopy(KV_DEVICE, KV_HOST, [1, 2], [3, 5])])
    step(ex, copies=[KVCopy(KV_HOST, KV_DISK, [3], [1])])
    want = blocks(caches, [1, 2])

    def read(tier: str, indices: list[int]) -> list[bytes]:
        return [bytes(p) for p in source.read_blocks(tier, indices)]

    as_bytes = [bytes(want[i].view(torch.uint8).flatten().numpy()) for i in range(2)]
    assert read(KV_DEVICE, [1, 2]) == as_bytes
    assert read(KV_HOST, [3, 5]) == as_bytes
    assert read(KV_DISK, [1]) == as_bytes[:1]
    for tier, indices in ((KV_DEVICE, [BLOCKS]), (KV_HOST, [-1]), ("gpu", [0])):
        with pytest.raises(LookupError):
            read(tier, indices)
    with pytest.raises(LookupError):
        read(KV_DISK, [0])  # never written
    flip_byte(ex, 1)
    with pytest.raises(KVIntegrityError):
        read(KV_DISK, [1])
    assert step(ex).kv_lost == {KV_DISK: [1]}


def test_without_lower_tiers_only_the_device_pool_is_served(tmp_path):
    caches = make_caches()
    ex = tiers(caches, tmp_path, kv_offloading_size=0.0, kv_offloading_disk_size=0.0)
    try:
        assert ex.host is None and ex.disk is None
        assert (ex.stats.num_host_blocks, ex.stats.num_disk_blocks) == (0, 0)
        source = ex.block_source()
        assert len(list(source.read_blocks(KV_DEVICE, [0, 1]))) == 2
        with pytest.raises(LookupError):
            source.read_blocks(KV_HOST, [0])
        with pytest.raises(ValueError, match="host"):
            step(ex, copies=[KVCopy(KV_DEVICE, KV_HOST, [0], [0])])
    finally:
        ex.close()
    assert list(tmp_path.iterdir()) == []
