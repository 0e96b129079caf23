"""Prometheus metrics of a worker process, measured where the step runs (the scheduler
measures round trips). One process hosts one worker, or several simulated ones: the metrics
cover them all, so their labels stay bounded (model_name only)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Histogram

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# vLLM's buckets for vllm:iteration_tokens_total
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class WorkerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.step_seconds = Histogram(
            "skiff_worker_step_seconds",
            "Time of one step on the worker (inputs, forward, sampling), steps with tokens.",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine step.",
            ["model_name"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.batch_size = Histogram(
            "skiff_worker_batch_size",
            "Requests scheduled per step.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.kv_blocks = Gauge(
            "skiff_worker_kv_cache_blocks",
            "KV cache blocks of the workers of this process.",
            registry=r,
        )
        self.load_seconds = Gauge(
            "skiff_worker_model_load_seconds",
            "Time to load the model: weights, KV cache and CUDA graphs.",
            registry=r,
        )

    def observe_step(self, seconds: float, num_tokens: int, num_reqs: int) -> None:
        self.step_seconds.observe(seconds)
        self.iteration_tokens.observe(num_tokens)
        self.batch_size.observe(num_reqs)
