"""Heartbeat, stats snapshot and Prometheus metrics, read from the workers' cores."""

from __future__ import annotations

from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.placement import Placement
from services.scheduler.request import Request
from services.scheduler.telemetry import Telemetry
from services.scheduler.worker_pool import WorkerPool
from shared.sampling_params import SamplingParams
from shared.wire import SchedulerStats, decoder, encode
from tests.scheduler.fakes import make_hello, unpaced_config


def make_telemetry() -> Telemetry:
    pool = WorkerPool(unpaced_config())
    placement = Placement(pool, wake=lambda _: None)
    return Telemetry("e", pool, placement, SchedulerMetrics("m"))


def test_reports_follow_the_cores():
    t = make_telemetry()
    assert t.heartbeat().num_ready_workers == 0
    t.placement.place(Request("early", [1, 2], SamplingParams()))  # no worker yet
    t.pool.register(make_hello("w0", num_blocks=8, max_model_len=128))
    t.placement.place(Request("a", list(range(40)), SamplingParams()))
    t.pool.workers["w0"].core.schedule()  # "a" runs on 3 of 8 blocks

    beat = t.heartbeat()
    assert (beat.num_ready_workers, beat.num_running, beat.num_waiting) == (1, 1, 1)
    assert beat.kv_cache_usage == 3 / 8 and beat.max_model_len == 128
    leaving = t.heartbeat(leaving=True)
    assert (leaving.num_ready_workers, leaving.leaving) == (0, True)

    stats = decoder(SchedulerStats).decode(encode(t.stats()))
    assert stats.num_requests == 2
    w0 = stats.workers["w0"]
    assert (w0.num_blocks, w0.num_free_blocks, w0.num_running) == (8, 5, 1)
    assert w0.statuses == {"a": "running"} and w0.prefix_cache_queries == 40
    assert w0.healthy

    t.pool.workers["w0"].healthy = False  # missed a step deadline
    assert t.heartbeat().num_ready_workers == 0
    assert not t.stats().workers["w0"].healthy

    t.refresh_gauges()
    t.refresh_gauges()  # counters follow the cores' totals, never count twice
    value = t.metrics.registry.get_sample_value
    labels = {"model_name": "m"}
    assert value("vllm:num_requests_running", labels) == 1
    assert value("vllm:kv_cache_usage_perc", labels) == 3 / 8
    assert value("vllm:prefix_cache_queries_total", labels) == 40
