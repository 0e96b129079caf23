"""The KV tiers' settings (validated, passed on by `skiff serve`), their metrics, and the
simulated worker's tiers: sizes in blocks of an 8B model, copies checked and counted, loads
that take their bytes' time at the modelled bandwidth."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.worker.config import RunnerConfig, SimConfig, WorkerServiceConfig
from services.worker.kv_tiers.sim_tiers import SIM_KV_BYTES_PER_TOKEN
from services.worker.kv_tiers.stats import KVTierStats
from services.worker.metrics import WorkerMetrics
from services.worker.service import WorkerService
from services.worker.sim_runner import SimRunner
from shared.wire import KV_DEVICE, KV_DISK, KV_HOST, BatchPlan, KVCopy, KVLoad
from tests.worker.test_sim_runner import BS, new, write_model_config

BLOCK_BYTES = SIM_KV_BYTES_PER_TOKEN * BS


@pytest.fixture
def model_dir(tmp_path):
    return write_model_config(tmp_path)


def sim(model_dir, host_blocks: int = 8, disk_blocks: int = 4, gbps: float = 25.0) -> SimRunner:
    config = RunnerConfig(
        model_dir=str(model_dir),
        block_size=BS,
        num_blocks=64,
        device="sim",
        kv_offloading_size=host_blocks * BLOCK_BYTES / 2**30,
        kv_offloading_disk_size=disk_blocks * BLOCK_BYTES / 2**30,
    )
    return SimRunner(config, SimConfig(sim_kv_load_gbps=gbps))


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (dict(kv_offloading_size=-1.0), "kv_offloading_size"),
        (dict(kv_offloading_disk_size=1.0), "needs the host tier"),
        (dict(kv_offloading_size=1.0, kv_offloading_disk_size=1.0), "kv_offloading_disk_path"),
    ],
)
def test_invalid_tier_settings_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        RunnerConfig(model_dir="unused", **bad)


def test_invalid_transfer_and_sim_settings_are_refused():
    with pytest.raises(ValueError, match="kv_transfer_port"):
        WorkerServiceConfig(kv_transfer_port=70000)
    with pytest.raises(ValueError, match="sim_kv_load_gbps"):
        SimConfig(sim_kv_load_gbps=0.0)
    # a simulated disk tier keeps nothing on disk: no directory needed
    RunnerConfig(model_dir="", device="sim", kv_offloading_size=1.0, kv_offloading_disk_size=1.0)


def test_serve_passes_the_tier_settings_to_its_workers(tmp_path):
    from services.cli import build_serve_parser, stack_config
    from services.launcher import Stack
    from services.worker.main import build_parser as worker_parser

    parser = build_serve_parser()
    argv = ["--kv-offloading-size", "2", "--kv-offloading-disk-size", "8"]
    argv += ["--kv-offloading-disk-path", str(tmp_path), "--model", "/m"]
    args, configs = parser.parse_configs(argv)
    stack = Stack(stack_config(parser, args, configs, args.model))
    spawned: dict[str, list[str]] = {}
    stack._spawn = lambda name, argv: spawned.setdefault(name, argv[3:])  # type: ignore[method-assign]
    stack.start_worker(0)
    parser = worker_parser()
    ns, _ = parser.parse_configs(spawned["worker-0"])
    runner = parser.config(RunnerConfig, ns, model_dir=ns.model)
    assert runner.kv_offloading_size == 2.0 and runner.kv_offloading_disk_size == 8.0
    assert runner.kv_offloading_disk_path == str(tmp_path)
    serve = build_serve_parser()
    args, configs = serve.parse_configs(argv[:4])
    with pytest.raises(SystemExit):  # a disk tier without its directory
        stack_config(serve, args, configs, "/m")


def test_simulated_tiers_have_the_configured_sizes(model_dir):
    r = sim(model_dir, host_blocks=8, disk_blocks=4)
    stats = r.kv_tiers.stats
    assert stats.capacity() == {KV_DEVICE: 64, KV_HOST: 8, KV_DISK: 4}
    assert stats.block_bytes == BLOCK_BYTES and r.kv_tiers.block_source() is None
    off = SimRunner(RunnerConfig(model_dir=str(model_dir), device="sim"), SimConfig())
    assert off.kv_tiers.stats.capacity()[KV_HOST] == 0


def test_a_simulated_worker_announces_its_tiers_and_serves_nothing(model_dir):
    service = WorkerService(WorkerServiceConfig(worker_id="w-sim", role="decode"), sim(model_dir))
    service.start_kv_transfer()
    hello = service.hello()
    assert (hello.num_host_blocks, hello.num_disk_blocks) == (8, 4)
    # no server: other simulated workers "fetch" from it at the modelled bandwidth
    assert hello.kv_block_bytes == BLOCK_BYTES and hello.kv_transfer_address == "sim"
    assert hello.role == "decode" and service.kv_transfer is None


def test_simulated_copies_are_checked_and_counted(model_dir):
    r = sim(model_dir)
    copies = [KVCopy(KV_DEVICE, KV_HOST, [3, 4], [0, 7]), KVCopy(KV_HOST, KV_DISK, [7], [3])]
    out = r.execute(BatchPlan(step_id=1, kv_copies=copies))
    assert out.kv_loads_done == [] and out.kv_load_s == 0.0
    assert r.kv_tiers.stats.offload_bytes == {KV_HOST: 2 * BLOCK_BYTES, KV_DISK: BLOCK_BYTES}
    for bad in (
        KVCopy(KV_DEVICE, KV_HOST, [64], [0]),
        KVCopy(KV_HOST, KV_DISK, [0], [4]),
        KVCopy(KV_DEVICE, KV_DISK, [0], [0]),
        KVCopy(KV_DEVICE, KV_HOST, [0, 1], [0]),
    ):
        with pytest.raises((ValueError, IndexError)):
            r.execute(BatchPlan(step_id=2, kv_copies=[bad]))


def test_simulated_loads_take_their_bytes_time(model_dir):
    r = sim(model_dir, gbps=0.1)
    loads = [
        KVLoad(load_id=1, block_ids=[10, 11], src_tier=KV_HOST, src=[0, 1]),
        KVLoad(load_id=2, block_ids=[12], src_tier=KV_DISK, src=[3]),
        KVLoad(load_id=3, block_ids=[13], src_tier=KV_DEVICE, src=[40], remote_address="h:1"),
        KVLoad(load_id=4, block_ids=[14], src_tier=KV_DISK, src=[4]),  # no such slot
        KVLoad(load_id=5, block_ids=[64], src_tier=KV_HOST, src=[0]),  # no such block
    ]
    plan = BatchPlan(
        step_id=1, new_reqs=[new("a", 3, [0])], num_scheduled_tokens={"a": 3}, kv_loads=loads
    )

    async def step() -> tuple[object, float]:
        started = time.perf_counter()
        out = await r.step(plan)
        return out, time.perf_counter() - started

    out, held_s = asyncio.run(step())
    assert out.kv_loads_done == [1, 2, 3] and out.kv_loads_failed == [4, 5]
    assert out.kv_load_bytes == 4 * BLOCK_BYTES
    assert out.kv_load_s == pytest.approx(4 * BLOCK_BYTES / 0.1e9)
    assert held_s >= out.kv_load_s > r.step_time_s(plan)  # the loads outlast the forward
    assert len(out.sampled_token_ids[0]) == 1
    stats = r.kv_tiers.stats
    assert stats.load_bytes == {
        KV_HOST: 2 * BLOCK_BYTES,
        KV_DISK: BLOCK_BYTES,
        "remote": BLOCK_BYTES,
    }
    assert stats.load_failures == {"io": 2}
    assert stats.read_seconds() == pytest.approx(
        {
            KV_HOST: 2 * BLOCK_BYTES / 0.1e9,
            KV_DISK: BLOCK_BYTES / 0.1e9,
            "remote": BLOCK_BYTES / 0.1e9,
        }
    )


def test_kv_tier_series_read_the_counters_at_each_scrape():
    metrics = WorkerMetrics("m")
    series = metrics.worker("w-0", connected=lambda: True)
    stats = KVTierStats(num_device_blocks=64, num_host_blocks=8, block_bytes=100)
    served = [0]
    series.watch_kv_tiers(stats, lambda: served[0])
    get = metrics.registry.get_sample_value
    w = {"worker_id": "w-0"}
    assert get("skiff:kv_tier_blocks", {**w, "tier": "host"}) == 8
    assert get("skiff:kv_tier_blocks", {**w, "tier": "disk"}) == 0
    assert get("skiff:kv_load_bytes_total", {**w, "source": "remote"}) == 0
    assert get("skiff:kv_load_failures_total", {**w, "reason": "checksum"}) == 0
    stats.add(stats.offload_bytes, KV_HOST, 300)
    stats.add(stats.load_bytes, "remote", 200)
    stats.add_seconds("remote", 0.25)
    stats.add(stats.load_failures, "transfer")
    stats.add(stats.disk_errors, "setup")
    served[0] = 1000
    assert get("skiff:kv_offload_bytes_total", {**w, "tier": "host"}) == 300
    assert get("skiff:kv_load_bytes_total", {**w, "source": "remote"}) == 200
    assert get("skiff:kv_load_seconds_total", {**w, "source": "remote"}) == 0.25
    assert get("skiff:kv_load_seconds_total", {**w, "source": "host"}) == 0
    assert get("skiff:kv_load_failures_total", {**w, "reason": "transfer"}) == 1
    assert get("skiff:kv_disk_tier_errors_total", {**w, "op": "setup"}) == 1
    assert get("skiff:kv_transfer_served_bytes_total", w) == 1000
