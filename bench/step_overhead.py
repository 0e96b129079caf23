"""Micro-benchmark of the scheduler's per-step CPU cost with N running decode requests:
`schedule()`, `update()`, and the wire codec of the plan and the result (what one worker step
costs the scheduler besides NATS itself).

    python bench/step_overhead.py [--num-reqs 256] [--steps 2000]
"""

from __future__ import annotations

import argparse
import time
from collections import deque

from services.scheduler.main import tune_gc
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerConfig
from shared.sampling_params import SamplingParams
from shared.wire import BatchPlan, ModelRunnerOutput, decoder, encode


def make_core(num_reqs: int, prompt_len: int, steps: int) -> Scheduler:
    """`num_reqs` requests with room for `steps` decode tokens each (no preemption)."""
    config = SchedulerConfig(max_num_seqs=num_reqs, max_num_batched_tokens=1 << 16)
    blocks_per_req = (prompt_len + steps + 2) // config.block_size + 1
    core = Scheduler(config, num_blocks=num_reqs * blocks_per_req, eos_token_ids=(2,))
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    for i in range(num_reqs):
        prompt = [(i * 7919 + j) % 30000 + 3 for j in range(prompt_len)]
        core.add_request(Request(f"cmpl-{i:032x}-0", prompt, params))
    return core


def result_for(plan: BatchPlan) -> ModelRunnerOutput:
    req_ids = list(plan.num_scheduled_tokens)
    return ModelRunnerOutput(
        step_id=plan.step_id, req_ids=req_ids, sampled_token_ids=[[17] for _ in req_ids]
    )


def measure(num_reqs: int, steps: int, prompt_len: int = 128) -> dict[str, float]:
    """Microseconds per step of each part, in the async pattern (two plans in flight)."""
    core = make_core(num_reqs, prompt_len, steps)
    plan_decoder, output_decoder = decoder(BatchPlan), decoder(ModelRunnerOutput)
    in_flight: deque[BatchPlan] = deque([core.schedule()])  # the prefill step
    core.update(result_for(in_flight.popleft()))
    totals = dict.fromkeys(("schedule", "update", "plan codec", "result codec"), 0.0)
    in_flight.append(core.schedule())
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = core.schedule()
        t1 = time.perf_counter()
        plan_decoder.decode(encode(plan))
        t2 = time.perf_counter()
        in_flight.append(plan)
        output = result_for(in_flight.popleft())
        t3 = time.perf_counter()
        output = output_decoder.decode(encode(output))
        t4 = time.perf_counter()
        core.update(output)
        t5 = time.perf_counter()
        totals["schedule"] += t1 - t0
        totals["plan codec"] += t2 - t1
        totals["result codec"] += t4 - t3
        totals["update"] += t5 - t4
    assert len(core.running) == num_reqs
    return {k: v / steps * 1e6 for k, v in totals.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-reqs", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args()
    tune_gc()  # as the scheduler service runs
    print(
        f"{'reqs':>5} {'schedule':>9} {'update':>9} {'sched+upd':>10} {'plan enc+dec':>13} "
        f"{'result enc+dec':>15}  (µs per step)"
    )
    for n in args.num_reqs:
        r = measure(n, args.steps)
        print(
            f"{n:>5} {r['schedule']:>9.1f} {r['update']:>9.1f} "
            f"{r['schedule'] + r['update']:>10.1f} {r['plan codec']:>13.1f} "
            f"{r['result codec']:>15.1f}"
        )


if __name__ == "__main__":
    main()
