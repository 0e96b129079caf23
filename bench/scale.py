"""Scale benchmark: nats-server, the real scheduler, K simulated workers and a closed-loop load
generator, sync vs async scheduling side by side in one run.

For each step time, K and mode it reports the device busy fraction (time in simulated steps /
wall time, per worker), plans/s, the scheduler's CPU per step, the inter-token latency beyond
the step time (p50/p99), and plan and result bytes. The load goes straight onto NATS (a
gateway's side of the wire) and, for small K, through the real gateway over HTTP.

    python bench/scale.py [--steps-ms 5 20] [--workers 1 4 16 64] [--quick]

Writes bench/results/scale.md and bench/results/scale.png.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.gateway.config import GatewayConfig
from services.launcher import Stack, StackConfig, free_port
from services.scheduler.config import SchedulerServiceConfig
from services.worker.config import RunnerConfig, SimConfig
from shared import bus
from shared.config import DEFAULT_SUBJECT_PREFIX, SchedulerConfig
from shared.default_model import DEFAULT_MODEL_NAME
from shared.sampling_params import SamplingParams
from shared.subjects import ANY_WORKER, Subjects, shard_prefixes
from shared.wire import (
    OutputBatch,
    SchedulerStats,
    SchedulerStatsRequest,
    SubmitReply,
    SubmitRequest,
    decoder,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as bench/scale.py: bench/ first would make bench.py `bench`

from bench.http_client import client_session, sse_chunks  # noqa: E402

RESULTS = Path(__file__).parent / "results"
PROMPT_LEN = 128
VOCAB = 49152  # the embedded model's; the simulated workers announce it too
CLOCK_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


class _ResultTiming(msgspec.Struct):
    """The fields of a ModelRunnerOutput this bench reads (the rest is skipped unparsed)."""

    worker_id: str
    execute_s: float
    idle_s: float


class _PlanShape(msgspec.Struct):
    """The field of a BatchPlan that sets its simulated step time."""

    num_scheduled_tokens: dict[str, int]


@dataclass(frozen=True)
class Case:
    mode: str  # "sync" or "async"
    step_ms: float
    num_workers: int
    via: str  # "nats" or "http"
    reqs_per_worker: int
    shards: int = 1  # scheduler shards, each owning every shards-th worker

    @property
    def prefixes(self) -> list[str]:
        return shard_prefixes(DEFAULT_SUBJECT_PREFIX, self.shards)


@dataclass
class Row:
    case: Case
    busy_mean: float
    busy_min: float
    step_lag_ms: float
    plans_per_s: float
    sched_cpu_us_per_step: float
    itl_extra_p50_ms: float
    itl_extra_p99_ms: float
    plan_bytes: float
    result_bytes: float
    tokens_per_s: float


@dataclass
class Window:
    """What the subscriptions saw between `start` and `stop`."""

    idle_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # per worker
    device_s: list[float] = field(default_factory=list)  # modelled time of each plan
    num_results: int = 0
    result_bytes: int = 0
    num_plans: int = 0
    plan_bytes: int = 0
    execute_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    num_tokens: int = 0
    open: bool = False


def cpu_seconds(pid: int) -> float:
    fields_ = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields_[11]) + int(fields_[12])) * CLOCK_TICK_S  # utime + stime


class Fleet:
    """nats-server for the whole run; per case a scheduler and one process of simulated
    workers (and a gateway for HTTP cases)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        # one bare broker (no users, plaintext) for every case's stack
        self.nats = Stack(self._config(nats_auth=False, nats_tls=False))
        self.nats.start_nats()
        self.nats_url = self.nats.nats_url
        self.stack: Stack | None = None
        self.sim: subprocess.Popen[bytes] | None = None

    def _config(self, **kw: Any) -> StackConfig:
        kw.setdefault("gateway", GatewayConfig(served_model_name=DEFAULT_MODEL_NAME))
        return StackConfig(RunnerConfig(model_dir=""), log_dir=str(self.log_dir), **kw)

    def start(self, case: Case) -> None:
        scheduler = SchedulerConfig(
            async_scheduling=case.mode == "async", max_num_seqs=max(case.reqs_per_worker, 1)
        )
        service = SchedulerServiceConfig(max_waiting=1 << 20)
        self.stack = Stack(
            self._config(
                nats_url=self.nats_url,
                gateway=GatewayConfig(served_model_name=DEFAULT_MODEL_NAME, port=free_port()),
                scheduler=scheduler,
                scheduler_service=service,
                scheduler_shards=case.shards,
            )
        )
        for shard in range(case.shards):
            self.stack.start_scheduler(shard)
        argv = [
            sys.executable, "-m", "services.worker.main", "--device", "sim",
            "--count", str(case.num_workers), "--nats-url", self.nats_url,
            "--worker-id", "sim", "--sim-step-base-ms", str(case.step_ms),
            "--max-num-seqs", str(max(case.reqs_per_worker, 1)),
            "--scheduler-shards", str(case.shards),
        ]  # fmt: skip
        with open(self.log_dir / "sim.log", "ab") as log:
            self.sim = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        if case.via == "http":
            self.stack.start_gateway()

    def stop(self) -> None:
        if self.sim is not None:
            self.sim.send_signal(signal.SIGKILL)
            self.sim.wait()
            self.sim = None
        if self.stack is not None:
            for proc in self.stack.procs.values():
                proc.kill()
                proc.wait()
            self.stack = None

    def close(self) -> None:
        self.stop()
        self.nats.stop()


async def wait_workers(nc: Client, case: Case, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            num_workers = 0
            for prefix in case.prefixes:
                stats = await bus.request(
                    nc, Subjects(prefix).scheduler_stats, SchedulerStatsRequest(), SchedulerStats, 2
                )
                num_workers += len(stats.workers)
            if num_workers >= case.num_workers:
                return
        except Exception:  # a scheduler is not up yet
            pass
        await asyncio.sleep(0.3)
    raise TimeoutError(f"{case.num_workers} workers did not register")


async def observe(nc: Client, window: Window, case: Case) -> None:
    """While the window is open: each worker's idle time waiting for plans (from its
    results), the modelled device time of every plan, and plan and result sizes."""
    timing, shape = decoder(_ResultTiming), decoder(_PlanShape)
    sim = SimConfig(sim_step_base_ms=case.step_ms)

    async def on_result(msg: Msg) -> None:
        if window.open:
            t = timing.decode(msg.data)
            window.idle_s[t.worker_id] += t.idle_s
            window.execute_s.append(t.execute_s)
            window.num_results += 1
            window.result_bytes += len(msg.data)

    async def on_plan(msg: Msg) -> None:
        if window.open:
            tokens = shape.decode(msg.data).num_scheduled_tokens
            device_s = sim.step_time_s(sum(tokens.values()), len(tokens))
            window.device_s.append(device_s)
            window.num_plans += 1
            window.plan_bytes += len(msg.data)

    for prefix in case.prefixes:
        s = Subjects(prefix)
        await nc.subscribe(s.result(ANY_WORKER), cb=on_result)
        await nc.subscribe(s.plan(ANY_WORKER), cb=on_plan)


class NatsLoad:
    """Keeps `concurrency` requests running by submitting a new one whenever one finishes,
    as a gateway would (submit request-reply, token deltas on its output subject), spreading
    them round-robin over the scheduler shards."""

    def __init__(
        self, nc: Client, window: Window, concurrency: int, max_tokens: int, prefixes: list[str]
    ) -> None:
        self.nc, self.window = nc, window
        self.subjects = [Subjects(p) for p in prefixes]
        self.concurrency, self.max_tokens = concurrency, max_tokens
        self.rng = random.Random(0)
        self.last_token_at: dict[str, float] = {}
        self.next_id = 0
        self.gateway_id = f"bench-{os.getpid()}"
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        for subjects in self.subjects:
            await bus.subscribe(
                self.nc, subjects.output(self.gateway_id), OutputBatch, self._on_output
            )
        await asyncio.gather(*(self._submit() for _ in range(self.concurrency)))

    async def _submit(self) -> None:
        req_id = f"bench-{self.next_id}"
        params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)
        prompt = [self.rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)]
        sub = SubmitRequest(
            req_id=req_id,
            gateway_id=self.gateway_id,
            prompt_token_ids=prompt,
            sampling_params=params,
        )
        self.next_id += 1
        subjects = self.subjects[self.next_id % len(self.subjects)]
        reply = await bus.request(self.nc, subjects.submit, sub, SubmitReply, 30)
        if not reply.accepted:
            raise RuntimeError(f"submit refused: {reply.status} {reply.message}")

    async def _on_output(self, batch: OutputBatch) -> None:
        now = time.perf_counter()
        for delta in batch.deltas:
            if delta.new_token_ids:
                record(self.window, self.last_token_at, delta.req_id, now, len(delta.new_token_ids))
            if delta.finish_reason is not None:
                self.last_token_at.pop(delta.req_id, None)
                task = asyncio.create_task(self._submit())
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)


def record(window: Window, last: dict[str, float], req_id: str, now: float, n: int) -> None:
    previous = last.get(req_id)
    last[req_id] = now
    if window.open:
        window.num_tokens += n
        if previous is not None:
            window.itl_s.append(now - previous)


class HttpLoad:
    """The same closed loop through the gateway's OpenAI API, streamed (made on the loop)."""

    def __init__(self, url: str, window: Window, concurrency: int, max_tokens: int) -> None:
        self.url, self.window = url, window
        self.concurrency, self.max_tokens = concurrency, max_tokens
        self.rng = random.Random(0)
        self.tasks: list[asyncio.Task[None]] = []
        self.client = client_session(timeout_s=300, max_connections=4096)

    async def start(self) -> None:
        self.tasks = [asyncio.create_task(self._loop(i)) for i in range(self.concurrency)]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.client.close()

    async def _loop(self, slot: int) -> None:
        last: dict[str, float] = {}
        while True:
            body = {
                "model": DEFAULT_MODEL_NAME,
                "prompt": [self.rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)],
                "max_tokens": self.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            async with self.client.post(f"{self.url}/v1/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {await r.read()!r}")
                async for chunk in sse_chunks(r):
                    if chunk.get("choices"):
                        record(self.window, last, str(slot), time.perf_counter(), 1)
            last.clear()


async def run_case(fleet: Fleet, case: Case, warmup_s: float, measure_s: float) -> Row:
    fleet.start(case)
    assert fleet.stack is not None
    nc = await bus.connect(fleet.nats_url, "skiff-bench")
    window = Window()
    http: HttpLoad | None = None
    try:
        await observe(nc, window, case)
        await wait_workers(nc, case)
        concurrency = case.num_workers * case.reqs_per_worker
        max_tokens = int(4 * (warmup_s + measure_s) * 1000 / case.step_ms) + 16  # never ends
        if case.via == "http":
            fleet.stack.wait_ready(60)
            http = HttpLoad(fleet.stack.url, window, concurrency, max_tokens)
            await http.start()
        else:
            await NatsLoad(nc, window, concurrency, max_tokens, case.prefixes).start()
        await asyncio.sleep(warmup_s)
        pids = [p.pid for name, p in fleet.stack.procs.items() if name.startswith("scheduler")]
        cpu0, t0 = sum(map(cpu_seconds, pids)), time.perf_counter()
        window.open = True
        await asyncio.sleep(measure_s)
        window.open = False
        wall, cpu = time.perf_counter() - t0, sum(map(cpu_seconds, pids)) - cpu0
    finally:
        if http is not None:
            await http.stop()
        await nc.close()
        fleet.stop()
    return summarize(case, window, wall, cpu)


def summarize(case: Case, w: Window, wall: float, cpu: float) -> Row:
    busy = [1 - idle / wall for idle in w.idle_s.values()]
    busy += [0.0] * (case.num_workers - len(busy))  # a worker that never ran a step
    step = statistics.fmean(w.device_s) if w.device_s else 0.0
    lag = statistics.fmean(w.execute_s) - step if w.execute_s else float("nan")
    extra = sorted(x - step for x in w.itl_s) or [float("nan")]
    return Row(
        case=case,
        busy_mean=statistics.fmean(busy),
        busy_min=min(busy),
        step_lag_ms=lag * 1e3,
        plans_per_s=w.num_results / wall,
        sched_cpu_us_per_step=cpu / max(w.num_results, 1) * 1e6,
        itl_extra_p50_ms=extra[len(extra) // 2] * 1e3,
        itl_extra_p99_ms=extra[min(len(extra) - 1, int(len(extra) * 0.99))] * 1e3,
        plan_bytes=w.plan_bytes / max(w.num_plans, 1),
        result_bytes=w.result_bytes / max(w.num_results, 1),
        tokens_per_s=w.num_tokens / wall,
    )


HEADER = (
    "| step ms | K | shards | via | reqs/worker | mode | busy mean | busy min | step lag ms "
    "| plans/s | tok/s "
    "| sched CPU µs/step | ITL−step p50 ms | ITL−step p99 ms | plan B | result B |"
)


def table_row(r: Row) -> str:
    c = r.case
    return (
        f"| {c.step_ms:g} | {c.num_workers} | {c.shards} | {c.via} | {c.reqs_per_worker} "
        f"| {c.mode} "
        f"| {r.busy_mean:.1%} | {r.busy_min:.1%} | {r.step_lag_ms:.2f} "
        f"| {r.plans_per_s:,.0f} | {r.tokens_per_s:,.0f} "
        f"| {r.sched_cpu_us_per_step:,.0f} | {r.itl_extra_p50_ms:.2f} | {r.itl_extra_p99_ms:.2f} "
        f"| {r.plan_bytes:,.0f} | {r.result_bytes:,.0f} |"
    )


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple[str, float], list[Row]] = defaultdict(list)
    for r in rows:
        if r.case.via == "nats" and r.case.shards == 1:
            series[(r.case.mode, r.case.step_ms)].append(r)
    for (mode, step_ms), rs in sorted(series.items()):
        rs.sort(key=lambda r: r.case.num_workers)
        ax.plot(
            [r.case.num_workers for r in rs],
            [r.busy_mean * 100 for r in rs],
            marker="o",
            linestyle="-" if mode == "async" else "--",
            label=f"{mode}, {step_ms:g} ms step",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("simulated workers per scheduler (K)")
    ax.set_ylabel("device busy, % of wall time (mean per worker)")
    ax.set_ylim(0, 105)
    ax.axhline(95, color="grey", linewidth=0.5)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("skiff: busy fraction vs workers, sync vs async scheduling")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps-ms", type=float, nargs="+", default=[5.0, 20.0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--reqs-per-worker", type=int, default=64)
    p.add_argument("--http-workers", type=int, nargs="*", default=[1, 4])
    p.add_argument(
        "--shards", type=int, nargs="*", default=[2], help="sharded rows at the largest K, async"
    )
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--measure", type=float, default=4.0)
    p.add_argument("--quick", action="store_true", help="K = 1 and 4, 5 ms only, short windows")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.quick:
        args.steps_ms, args.workers, args.http_workers, args.shards = [5.0], [1, 4], [1], [2]
        args.warmup, args.measure = 1.0, 2.0
    cases = [
        Case(mode, step_ms, k, "nats", args.reqs_per_worker)
        for step_ms in args.steps_ms
        for k in args.workers
        for mode in ("sync", "async")
    ]
    cases += [
        Case("async", args.steps_ms[0], max(args.workers), "nats", args.reqs_per_worker, shards)
        for shards in args.shards
    ]
    cases += [
        Case(mode, args.steps_ms[0], k, "http", min(args.reqs_per_worker, 32))
        for k in args.http_workers
        for mode in ("sync", "async")
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="skiff-scale-"))
    print(f"service logs: {log_dir}", flush=True)
    fleet = Fleet(log_dir)
    rows: list[Row] = []
    print(HEADER, flush=True)
    try:
        for case in cases:
            row = asyncio.run(run_case(fleet, case, args.warmup, args.measure))
            rows.append(row)
            print(table_row(row), flush=True)
    finally:
        fleet.close()
    write_report(rows, args, args.out)


def write_report(rows: list[Row], args: argparse.Namespace, out: Path) -> None:
    first = [
        f"busy at {r.case.step_ms:g} ms, K=1, {r.case.mode}: {r.busy_mean:.1%}"
        for r in rows
        if r.case.num_workers == 1 and r.case.via == "nats"
    ]
    lines = [
        "# Scale benchmark (simulated workers)",
        "",
        f"`python bench/scale.py` on {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}; "
        f"prompt {PROMPT_LEN} tokens, {args.reqs_per_worker} running requests per worker "
        f"(HTTP: up to 32), warmup {args.warmup:g} s, window {args.measure:g} s. Everything "
        "(nats-server, scheduler, simulated workers, load generator, gateway) shares this "
        "machine.",
        "",
        *[f"- {line}" for line in first],
        "",
        HEADER,
        "|" + "---|" * (HEADER.count("|") - 1),
        *[table_row(r) for r in rows],
        "",
        "busy: 1 − the time each worker sat waiting for its next plan / wall time (what the "
        "worker reports as `idle_s` with each result). step lag: a step's wall time on the "
        "simulated worker minus its modelled "
        "time (the simulator's host falling behind). ITL−step: inter-token latency seen by "
        "the load generator minus the mean modelled step time. sched CPU: "
        "the scheduler processes' CPU time per plan (schedule, update, codec, NATS I/O). "
        "shards > 1: that many schedulers, each owning every shards-th worker.",
        "",
    ]
    (out / "scale.md").write_text("\n".join(lines))
    plot(rows, out / "scale.png")
    for line in first:
        print(line)
    print(f"wrote {out / 'scale.md'} and {out / 'scale.png'}")


if __name__ == "__main__":
    main()
