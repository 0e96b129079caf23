"""Prometheus metrics of a worker process, measured where the step runs (the scheduler
measures round trips). One process hosts one worker, or several simulated ones: series carry
`worker_id` (and vLLM's `model_name` where vLLM has it), never a request id; `phase`, `state`,
`kind`, `mode`, `tier`, `source`, `reason` and `op` take the few fixed values below. The KV
tiers' series are read from their counters at each scrape."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.worker.input_batch import InputBatch
from services.worker.kv_tiers.stats import (
    DISK_OPS,
    LOAD_FAILURES,
    LOAD_SOURCES,
    KVTierStats,
)
from services.worker.step_timer import PHASES, StepTimer
from shared.wire import KV_DISK, KV_HOST

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, *STEP_BUCKETS)
# vLLM's buckets for vllm:iteration_tokens_total
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
WID = ["worker_id"]


class WorkerMetrics:
    """The families of one process; `worker(worker_id, ...)` gives a worker its series."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_start_time_seconds
        self._add_step_metrics()
        self._add_device_metrics()
        self.kv_tiers = KVTierCollector()
        r.register(self.kv_tiers)
        self.lora = LoRACollector()
        r.register(self.lora)

    def _add_step_metrics(self) -> None:
        """Per step: time, phases, tokens, requests and how the forward pass ran."""
        r = self.registry
        self.step_seconds = Histogram(
            "skiff_worker_step_seconds",
            "Time of one step on the worker (inputs, forward, sampling), steps with tokens.",
            WID,
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.phase_seconds = Histogram(
            "skiff_worker_step_phase_seconds",
            "Time of one phase of a step: prepare, forward, sample, write_back "
            "(on CUDA, forward and sample are device time from CUDA events).",
            [*WID, "phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine step.",
            ["model_name", *WID],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "skiff_worker_batch_size",
            "Requests scheduled per step.",
            WID,
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.forward_steps = Counter(
            "skiff_worker_forward_steps",
            "Forward passes by mode: cuda_graph (a captured graph replayed) or eager.",
            [*WID, "mode"],
            registry=r,
        )

    def _add_device_metrics(self) -> None:
        """The device, the model's load and the worker's links."""
        r = self.registry
        self.kv_blocks = Gauge(
            "skiff_worker_kv_cache_blocks",
            "KV cache blocks on the device: used by the worker's requests, or free.",
            [*WID, "state"],
            registry=r,
        )
        self.device_memory = Gauge(
            "skiff_worker_device_memory_bytes",
            "Device memory: kv_cache (its tensors); on CUDA also allocated and reserved by "
            "torch, and total.",
            [*WID, "kind"],
            registry=r,
        )
        self.epoch_changes = Counter(
            "skiff_worker_scheduler_epoch_changes",
            "Plans of a new scheduler epoch after an earlier one: the scheduler restarted or "
            "another took over.",
            WID,
            registry=r,
        )
        self.nats_connected = Gauge(
            "skiff_nats_connected", "1 while connected to NATS.", WID, registry=r
        )
        self.load_seconds = Gauge(
            "skiff_worker_model_load_seconds",
            "Time to load the model: weights, KV cache and CUDA graphs.",
            registry=r,
        )

    def worker(self, worker_id: str, connected: Callable[[], bool]) -> WorkerSeries:
        return WorkerSeries(self, worker_id, connected)


class WorkerSeries:
    """The series of one worker, created up front so that they read 0 before the first step."""

    def __init__(self, m: WorkerMetrics, wid: str, connected: Callable[[], bool]) -> None:
        self.step_seconds = m.step_seconds.labels(wid)
        self.phases = {p: m.phase_seconds.labels(wid, p) for p in PHASES}
        self.iteration_tokens = m.iteration_tokens.labels(m.model_name, wid)
        self.batch_size = m.batch_size.labels(wid)
        self.forward_steps = {
            True: m.forward_steps.labels(wid, "cuda_graph"),
            False: m.forward_steps.labels(wid, "eager"),
        }
        self.kv_used = m.kv_blocks.labels(wid, "used")
        self.kv_free = m.kv_blocks.labels(wid, "free")
        self.epoch_changes = m.epoch_changes.labels(wid)
        m.nats_connected.labels(wid).set_function(lambda: float(connected()))
        self._memory = m.device_memory
        self._kv_tiers = m.kv_tiers
        self._lora = m.lora
        self._wid = wid

    def observe_step(self, seconds: float, num_tokens: int, num_reqs: int) -> None:
        self.step_seconds.observe(seconds)
        self.iteration_tokens.observe(num_tokens)
        self.batch_size.observe(num_reqs)

    def observe_timer(self, timer: StepTimer) -> None:
        for phase, seconds in timer.seconds.items():
            self.phases[phase].observe(seconds)
        if timer.cuda_graph is not None:
            self.forward_steps[timer.cuda_graph].inc()

    def watch_kv_tiers(self, stats: KVTierStats, served_bytes: Callable[[], int]) -> None:
        """The KV tiers' series of this worker, from `stats` and the bytes its KV-transfer
        server sent (`served_bytes`), read at each scrape."""
        self._kv_tiers.watch(self._wid, stats, served_bytes)

    def watch_lora(self, runner: Any) -> None:
        """The adapter slots of a runner with LoRA on (`runner.lora`), read at each scrape."""
        lora = getattr(runner, "lora", None)
        if lora is not None:
            self._lora.watch(self._wid, lora)

    def set_kv_blocks(self, batch: InputBatch, num_blocks: int) -> None:
        used = kv_blocks_in_use(batch)
        self.kv_used.set(used)
        self.kv_free.set(num_blocks - used)

    def watch_device(self, runner: Any) -> None:
        """Device memory of a model runner (a simulated one has none), read at each scrape."""
        caches = getattr(runner, "kv_caches", None)
        if caches is None:
            return
        kv_bytes = sum(t.numel() * t.element_size() for t in caches)
        self._memory.labels(self._wid, "kv_cache").set(kv_bytes)
        device = runner.device
        if device.type != "cuda":
            return
        import torch

        readings: dict[str, Callable[[], float]] = {
            "allocated": lambda: torch.cuda.memory_allocated(device),
            "reserved": lambda: torch.cuda.memory_reserved(device),
            "total": lambda: torch.cuda.mem_get_info(device)[1],
        }
        for kind, read in readings.items():
            self._memory.labels(self._wid, kind).set_function(read)


def kv_blocks_in_use(batch: InputBatch) -> int:
    """Distinct KV blocks in the block tables of the batch's requests (shared prefix blocks
    count once)."""
    n = batch.num_reqs
    if n == 0:
        return 0
    width = int(batch.num_blocks[:n].max())
    table = batch.block_table[:n, :width]
    mask = np.arange(width) < batch.num_blocks[:n, None]
    return int(np.unique(table[mask]).size)


class KVTierCollector(Collector):
    """The KV tiers' series of every worker of the process: capacity, bytes offloaded, loaded
    and served, failed loads and disk-tier errors."""

    def __init__(self) -> None:
        self._workers: dict[str, tuple[KVTierStats, Callable[[], int]]] = {}
        self._lock = threading.Lock()

    def watch(self, wid: str, stats: KVTierStats, served_bytes: Callable[[], int]) -> None:
        with self._lock:
            self._workers[wid] = (stats, served_bytes)

    def collect(self) -> Iterator[Metric]:
        blocks = GaugeMetricFamily(
            "skiff:kv_tier_blocks",
            "KV blocks each tier holds at most: device, host and disk (0: off).",
            labels=[*WID, "tier"],
        )
        offload = CounterMetricFamily(
            "skiff:kv_offload_bytes",
            "KV bytes copied down into the host and disk tiers.",
            labels=[*WID, "tier"],
        )
        loads = CounterMetricFamily(
            "skiff:kv_load_bytes",
            "KV bytes loaded into the device pool, by source: host, disk or remote (another "
            "worker's).",
            labels=[*WID, "source"],
        )
        load_seconds = CounterMetricFamily(
            "skiff:kv_load_seconds",
            "Time the loader spent on KV loads, by source (host, disk, remote): bytes over "
            "seconds is each path's bandwidth.",
            labels=[*WID, "source"],
        )
        failures = CounterMetricFamily(
            "skiff:kv_load_failures",
            "KV loads that failed, by reason: checksum (data did not verify), io (a local "
            "read), transfer (a fetch from another worker).",
            labels=[*WID, "reason"],
        )
        disk = CounterMetricFamily(
            "skiff:kv_disk_tier_errors",
            "Disk tier errors by operation: setup (the tier is off), write or read (the "
            "slot is lost).",
            labels=[*WID, "op"],
        )
        served = CounterMetricFamily(
            "skiff:kv_transfer_served_bytes",
            "KV bytes this worker's KV-transfer server sent to other workers.",
            labels=WID,
        )
        with self._lock:
            workers = list(self._workers.items())
        for wid, (stats, served_bytes) in workers:
            for tier, n in stats.capacity().items():
                blocks.add_metric([wid, tier], n)
            _add_counts(offload, wid, (KV_HOST, KV_DISK), stats.read(stats.offload_bytes))
            _add_counts(loads, wid, LOAD_SOURCES, stats.read(stats.load_bytes))
            _add_counts(load_seconds, wid, LOAD_SOURCES, stats.read_seconds())
            _add_counts(failures, wid, LOAD_FAILURES, stats.read(stats.load_failures))
            _add_counts(disk, wid, DISK_OPS, stats.read(stats.disk_errors))
            served.add_metric([wid], served_bytes())
        yield from (blocks, offload, loads, load_seconds, failures, disk, served)


class LoRACollector(Collector):
    """The LoRA adapter slots of every worker of the process with LoRA on: adapters read
    into a slot, the time that took, adapters evicted, slots in use."""

    def __init__(self) -> None:
        self._workers: dict[str, Any] = {}  # worker id -> its LoRAManager
        self._lock = threading.Lock()

    def watch(self, wid: str, manager: Any) -> None:
        with self._lock:
            self._workers[wid] = manager

    def collect(self) -> Iterator[Metric]:
        loads = CounterMetricFamily(
            "skiff_worker_lora_loads", "LoRA adapters read into a slot.", labels=WID
        )
        seconds = CounterMetricFamily(
            "skiff_worker_lora_load_seconds",
            "Time spent reading LoRA adapters into slots.",
            labels=WID,
        )
        evictions = CounterMetricFamily(
            "skiff_worker_lora_evictions",
            "LoRA adapters that gave their slot up to another (least recently used first).",
            labels=WID,
        )
        slots = GaugeMetricFamily(
            "skiff_worker_lora_slots",
            "LoRA adapter slots, used (holding an adapter) or free.",
            labels=[*WID, "state"],
        )
        with self._lock:
            workers = list(self._workers.items())
        for wid, m in workers:
            loads.add_metric([wid], m.num_loads)
            seconds.add_metric([wid], m.load_seconds)
            evictions.add_metric([wid], m.slots.num_evictions)
            used = len(m.slots.names())
            slots.add_metric([wid, "used"], used)
            slots.add_metric([wid, "free"], m.max_loras - used)
        yield from (loads, seconds, evictions, slots)


def _add_counts(
    family: CounterMetricFamily,
    wid: str,
    labels: tuple[str, ...],
    counts: dict[str, int] | dict[str, float],
) -> None:
    """One series per label, 0 for those not counted yet."""
    for label in labels:
        family.add_metric([wid, label], counts.get(label, 0))
