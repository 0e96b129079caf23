"""The shard's prefix summary in its heartbeat: every worker's cached blocks, in the block size
the workers share."""

from __future__ import annotations

from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.placement import Placement
from services.scheduler.prefix_summaries import summarize
from services.scheduler.request import Request
from services.scheduler.telemetry import Telemetry
from services.scheduler.worker_pool import WorkerPool
from shared.prefix_hash import iter_block_hashes
from shared.prefix_summary import PrefixSummary
from shared.sampling_params import SamplingParams
from shared.wire import SchedulerHeartbeat, decoder, encode
from tests.scheduler.fakes import make_hello, unpaced_config


def test_the_heartbeat_summarizes_every_workers_cached_blocks():
    pool = WorkerPool(unpaced_config())
    placement = Placement(pool, wake=lambda _: None)
    telemetry = Telemetry("e", pool, placement, SchedulerMetrics("m"), 1024)
    assert (telemetry.heartbeat().block_size, telemetry.heartbeat().prefix_summary) == (0, b"")

    prompts = {"w0": list(range(40)), "w1": list(range(100, 164))}
    for worker_id, prompt in prompts.items():
        core = pool.register(make_hello(worker_id, num_blocks=8))[0].core
        core.add_request(Request(f"r-{worker_id}", prompt, SamplingParams()))
        core.schedule()  # caches the prompt's full blocks: 2 on w0, 4 on w1

    beat = decoder(SchedulerHeartbeat).decode(encode(telemetry.heartbeat()))
    assert beat.block_size == 16 and len(beat.prefix_summary) <= 1024
    summary = PrefixSummary(beat.prefix_summary)
    assert len(summary) == 6
    assert summary.longest_prefix(list(iter_block_hashes(list(range(48)), 16))) == 2
    assert summary.longest_prefix(list(iter_block_hashes(list(range(100, 180)), 16))) == 4
    assert summary.longest_prefix(list(iter_block_hashes(list(range(1, 48)), 16))) == 0

    leaving = telemetry.heartbeat(leaving=True)
    assert (leaving.block_size, leaving.prefix_summary) == (0, b"")


def test_workers_of_another_block_size_than_the_first_are_left_out():
    pool = WorkerPool(unpaced_config())
    for worker_id, block_size in (("w0", 16), ("w1", 32)):
        core = pool.register(make_hello(worker_id, block_size=block_size))[0].core
        core.add_request(Request(f"r-{worker_id}", list(range(64)), SamplingParams()))
        core.schedule()
    block_size, blob = summarize(w.core.kv for w in pool.workers.values())
    assert block_size == 16 and len(PrefixSummary(blob)) == 4
    assert summarize([]) == (0, b"")
