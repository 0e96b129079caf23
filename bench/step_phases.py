"""Where a single-stream CPU decode step goes: one greedy request through `LLM.generate`, and
per decode step the runner's phases (services/worker/step_timer.py: prepare, forward, sample,
write-back), the whole `execute` and the engine's time between two steps.

    python -m bench.step_phases [--prompt-tokens 16] [--tokens 129] [--rounds 3]
        [--cpu-weights fp32]

Prints, per round, the medians over the decode steps (the prefill and the first decode step
left out) in microseconds and the tok/s they add up to. Single runs swing with the memory
bandwidth other tenants leave; compare rounds of one process, or alternate builds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpu_step import greedy  # noqa: E402
from bench.roofline import cpu_line  # noqa: E402
from bench.workload import token_prompts  # noqa: E402
from services.offline import LLM  # noqa: E402
from services.worker.step_timer import PHASES  # noqa: E402
from shared.wire import BatchPlan, ModelRunnerOutput  # noqa: E402

Step = dict[str, float]  # phase (and "execute", "between") -> seconds


def recorded_steps(llm: LLM) -> list[Step]:
    """Wraps the runner's `execute` to record each step's phases into the returned list."""
    runner, steps = llm.runner, []
    execute, last_end = runner.execute, [0.0]

    def timed_execute(plan: BatchPlan) -> ModelRunnerOutput:
        start = time.perf_counter()
        out = execute(plan)
        end = time.perf_counter()
        between = start - last_end[0] if last_end[0] else 0.0
        steps.append({**runner.timer.seconds, "execute": end - start, "between": between})
        last_end[0] = end
        return out

    runner.execute = timed_execute  # type: ignore[method-assign]
    return steps


def summary(steps: list[Step]) -> str:
    """Median µs of each phase over the decode steps, and the tok/s of execute + between."""
    decode = steps[2:]  # the prefill, then the first decode step (cold)
    names = [*PHASES, "execute", "between"]
    us = {n: median(s.get(n, 0.0) for s in decode) * 1e6 for n in names}
    rate = 1e6 / (us["execute"] + us["between"])
    return " ".join(f"{n} {us[n]:.0f}" for n in names) + f" us -> {rate:.1f} tok/s"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--tokens", type=int, default=129)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cpu-weights", default="fp32")
    args = p.parse_args()
    print(cpu_line())
    llm = LLM(max_num_seqs=32, cpu_weights=args.cpu_weights, enable_prefix_caching=False)
    steps = recorded_steps(llm)
    prompt = token_prompts(llm.tokenizer, [args.prompt_tokens], seed=3)[0]  # as tg_prompt
    for _ in range(args.rounds):
        steps.clear()
        llm.generate([prompt], greedy(args.tokens))
        print(summary(steps))


if __name__ == "__main__":
    main()
