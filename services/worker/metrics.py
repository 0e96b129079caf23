"""Prometheus metrics of a worker process, measured where the step runs (the scheduler
measures round trips). One process hosts one worker, or several simulated ones: series carry
`worker_id` (and vLLM's `model_name` where vLLM has it), never a request id; `phase`, `state`,
`kind` and `mode` take the few fixed values below."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from services.worker.input_batch import InputBatch
from services.worker.step_timer import PHASES, StepTimer

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
