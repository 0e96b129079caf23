"""NATS TLS on against off on the served path: the reference workload through two real stacks.

    python -m bench.tls [--requests 32] [--rounds 2] [--concurrency N] [--out PATH]

Each round starts both stacks (nats-server, scheduler, one CPU worker, gateway; one with NATS
over TLS as `skiff serve` runs it, one plaintext) side by side, the idle one only sending
heartbeats, and runs the workload on them in turns, off, on, on, off, so that a drift of the
shared machine weighs on both alike; which stack starts first alternates between rounds (in
trials the one started first ran slower, whichever it was). Each pair of consecutive runs gives
a ratio (tokens/s TLS on / off); the result is the median of those. Where a difference
comes from: each stack's processes' CPU time per output token over the measured runs (less
noisy than tokens/s: others' load stretches the wall time, not the work) and the scheduler's
mean step (the NATS round trip is plan out and result back less the worker's time). Writes
`--out` (JSON, default bench/results/tls.json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.http_client import client_session  # noqa: E402
from bench.scale import cpu_seconds  # noqa: E402
from bench.served import (  # noqa: E402
    histogram_means,
    run_at,
    served_stack,
    start_or_show_logs,
)
from bench.workload import reference_workload  # noqa: E402
from services.launcher import Stack  # noqa: E402

STEP_METRICS = {  # label: the scheduler histogram whose mean it is
    "nats round trip ms": "skiff_nats_round_trip_seconds",
    "worker execute ms": "skiff_worker_execute_seconds",
    "schedule ms": "skiff_schedule_seconds",
}


@dataclass
class TlsRun:
    """One pass of the workload through one stack."""

    tls: bool
    tokens_per_s: float
    elapsed_s: float


@dataclass
class TlsResult:
    """The runs in their order, whether each round started the TLS stack first; per stack
    ("on"/"off"), its processes' CPU ms per output token over the runs and its scheduler's mean
    step (ms; plan bytes; warm-up included, mean over rounds)."""

    requests: int
    concurrency: int
    runs: list[TlsRun] = field(default_factory=list)
    tls_started_first: list[bool] = field(default_factory=list)
    cpu_ms_per_token: dict[str, dict[str, float]] = field(default_factory=dict)
    steps: dict[str, dict[str, float]] = field(default_factory=dict)

    def pair_ratios(self) -> list[float]:
        """Tokens/s on / off of each pair of consecutive runs (one of each, in turn order)."""
        ratios = []
        for a, b in zip(self.runs[::2], self.runs[1::2], strict=True):
            on, off = (a, b) if a.tls else (b, a)
            if on.tls == off.tls:
                raise ValueError("a pair of runs must have TLS once on and once off")
            ratios.append(on.tokens_per_s / off.tokens_per_s)
        return ratios

    def ratio(self) -> float:
        return statistics.median(self.pair_ratios())

    def cpu_ratio(self) -> float:
        """CPU per output token, all processes, off / on: the throughput ratio of a machine
        the stack keeps busy, free of the wall-clock noise of others' load."""
        on, off = (sum(self.cpu_ms_per_token[k].values()) for k in ("on", "off"))
        return off / on

    def report(self) -> list[str]:
        """The runs, the pair ratios and each stack's mean step, then the ratio line."""
        lines = [f"{'run':>3} {'NATS':<5} {'output tok/s':>12} {'elapsed s':>9}"]
        for i, r in enumerate(self.runs, 1):
            name = "tls" if r.tls else "plain"
            lines.append(f"{i:>3} {name:<5} {r.tokens_per_s:>12.1f} {r.elapsed_s:>9.2f}")
        firsts = ", ".join("tls" if tls else "plain" for tls in self.tls_started_first)
        lines.append(f"started first, per round of {len(turns(1))} runs: {firsts}")
        lines.append("pair ratios on / off: " + " ".join(f"{x:.3f}" for x in self.pair_ratios()))
        for name, cpu in self.cpu_ms_per_token.items():
            lines.append(
                f"CPU ms per output token, NATS TLS {name}: "
                + ", ".join(f"{proc} {ms:.2f}" for proc, ms in cpu.items())
                + f", total {sum(cpu.values()):.2f}"
            )
        for name, step in self.steps.items():
            lines.append(
                f"mean step, NATS TLS {name}: "
                + ", ".join(f"{label} {value:.2f}" for label, value in step.items())
            )
        lines.append(f"CPU per output token ratio off / on: {self.cpu_ratio():.3f}")
        lines.append(self.ratio_line())
        return lines

    def ratio_line(self) -> str:
        return f"served throughput ratio NATS TLS on / off: {self.ratio():.2f}"

    def as_json(self) -> dict[str, Any]:
        ratios = {"pair_ratios": self.pair_ratios(), "cpu_ratio": self.cpu_ratio()}
        return {**asdict(self), **ratios, "ratio": self.ratio()}


def turns(rounds: int) -> list[bool]:
    """TLS on (True) or off of each run: `rounds` times off, on, on, off."""
    return [False, True, True, False] * rounds


Stacks = dict[bool, Stack]  # TLS on (True) or off -> its stack


def mean_step(stack_means: dict[str, float]) -> dict[str, float]:
    """The scheduler histograms' means in ms, and the plan's bytes."""
    step = {label: stack_means.get(name, 0.0) * 1e3 for label, name in STEP_METRICS.items()}
    step["plan bytes"] = stack_means.get("skiff_plan_bytes", 0.0)
    return step


def stack_cpu_seconds(stack: Stack) -> dict[str, float]:
    """CPU seconds (user + system) each of the stack's processes has used so far."""
    return {name: cpu_seconds(proc.pid) for name, proc in stack.procs.items()}


def start_pair(model_dir: str, first: bool, log_dir: Path, up: contextlib.ExitStack) -> Stacks:
    """Both stacks started, the one with TLS `first` first, each stopped when `up` closes."""
    stacks = {}
    for tls in (first, not first):
        stack_logs = log_dir / ("on" if tls else "off")
        stack = served_stack(model_dir, tls, str(stack_logs))
        start_or_show_logs(stack, stack_logs)
        up.callback(stack.stop)
        stacks[tls] = stack
    return stacks


async def run_round(
    stacks: Stacks, prompts: list[list[int]], outputs: list[int], limit: int
) -> tuple[list[TlsRun], dict[bool, dict[str, float]]]:
    """Warm each stack up (every prompt, 2 tokens each), then one round of turns; the runs and
    the CPU seconds each stack's processes used over them."""
    async with client_session() as client:
        for stack in stacks.values():  # the workload's prefill and batch shapes, once
            await run_at(client, stack.url, prompts, [2] * len(prompts), limit)
        before = {tls: stack_cpu_seconds(stack) for tls, stack in stacks.items()}
        runs = []
        for tls in turns(1):
            elapsed, _ = await run_at(client, stacks[tls].url, prompts, outputs, limit)
            runs.append(TlsRun(tls, sum(outputs) / elapsed, elapsed))
    used = {}
    for tls, stack in stacks.items():
        after = stack_cpu_seconds(stack)
        used[tls] = {name: after[name] - before[tls][name] for name in after}
    return runs, used


def run(
    model_dir: str,
    prompts: list[list[int]],
    outputs: list[int],
    rounds: int = 2,
    concurrency: int | None = None,
    log_dir: Path = Path("/tmp/skiff-bench/tls"),
) -> TlsResult:
    """`rounds` rounds, each on two freshly started stacks: the stack started first ran
    slower in trials here, so the start order alternates (plaintext first in odd rounds)."""
    result = TlsResult(len(prompts), concurrency or len(prompts))
    cpu: dict[bool, dict[str, float]] = {True: {}, False: {}}
    means: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for r in range(rounds):
        with contextlib.ExitStack() as up:
            stacks = start_pair(model_dir, r % 2 == 1, log_dir, up)
            result.tls_started_first.append(r % 2 == 1)
            runs, used = asyncio.run(run_round(stacks, prompts, outputs, result.concurrency))
            result.runs += runs
            for tls, stack in stacks.items():
                for name, seconds in used[tls].items():
                    cpu[tls][name] = cpu[tls].get(name, 0.0) + seconds
                means[tls].append(mean_step(histogram_means(stack)))
    tokens = 2 * rounds * sum(outputs)  # per stack
    for tls, key in ((False, "off"), (True, "on")):
        result.cpu_ms_per_token[key] = {n: sec * 1e3 / tokens for n, sec in cpu[tls].items()}
        result.steps[key] = {k: statistics.fmean(m[k] for m in means[tls]) for k in means[tls][0]}
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="rounds of off, on, on, off")
    p.add_argument("--concurrency", type=int, help="requests in flight (default: all)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "tls.json"))
    args_given = sys.argv[1:] if argv is None else argv
    args = p.parse_args(args_given)
    from bench import roofline
    from services.worker.gguf_convert import ensure_default_model
    from shared.tokenizer import Tokenizer

    model_dir = ensure_default_model()
    prompts, outputs = reference_workload(Tokenizer(model_dir), args.requests)
    load_before = os.getloadavg()[0]
    result = run(str(model_dir), prompts, outputs, args.rounds, args.concurrency)
    load_after = os.getloadavg()[0]
    cpu = roofline.cpu_line()
    print(cpu)
    print(
        f"workload: {len(prompts)} requests, {result.concurrency} in flight, prompt tokens "
        f"{sum(map(len, prompts))}, output tokens {sum(outputs)}; "
        f"load average {load_before:.1f} before, {load_after:.1f} after"
    )
    print("\n".join(result.report()))
    report = {
        "command": shlex.join(["python", "-m", "bench.tls", *args_given]),
        "cpu": cpu,
        "load_average_1m": {"before": load_before, "after": load_after},
        **result.as_json(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
