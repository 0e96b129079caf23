"""Prefill/decode disaggregation on the served stack: steady decodes while long prompts arrive,
colocated (mixed workers) against disaggregated (prefill + decode workers) at equal worker
count, on CPU workers and on simulated workers at H200 step times, in one run.

    python -m bench.pd [--quick] [--parts cpu,sim] [--out bench/results/pd.json]

Each mode is a stack of its own (bench/served.py's processes). The workload, the same in both
modes of a part: `steady` greedy streams (short prompts, `ignore_eos`) run in closed loop, each
sending its next request when one ends. Once every stream has its first token they run alone
for `idle_s` (the idle window), then the long prompts arrive one every `every_s` seconds, each
streaming `long_max_tokens` greedy tokens (so that it is handed over to a decode worker and
decodes there); the loaded window lasts until the last long prompt ends. Per mode it prints the
steady streams' ITL p50/p99 (the gaps between chunks of one stream, both ends in the window)
idle and loaded, the long prompts' TTFT p50/p99, and the steady streams' output tokens/s in
each window.

- cpu: the embedded SmolLM2-135M, 2 workers of one core each: colocated = 2 mixed, disaggregated
  = 1 prefill + 1 decode. The workers start with OMP_NUM_THREADS=1 (torch's and the C++ ops'
  intra-op pool: one thread) and each is pinned to its own core (every thread of worker i on
  core i mod cores), so that the two modes split the machine the same way and a prefill cannot
  borrow the decode worker's core; gateway, scheduler, NATS and this client float over both.
  Long prompts are cut from Python's library sources (bench/long_prompts.py); the greedy texts
  of the long prompts in the two modes are compared (`output differences: N`). The decode
  worker's KV fetches give the transfer rate: its `skiff:kv_load_bytes{source="remote"}` over
  its `skiff:kv_load_seconds{source="remote"}` (the loader's time on them), against a plain
  loopback TCP connection's bandwidth measured in the same run
  (services/worker/kv_transfer/loopback.py). The transfer path alone (a fetch of 64 blocks from
  a TransferServer in this process, each copied out) is printed too, as a diagnosis.
- sim: simulated workers (`--worker-device sim`, an 8B model's step times on one H200: a
  16-request decode step takes ~5.7 ms), 16 steady streams and 8,000-token prompts (the model
  directory's context is 8,192 tokens), the hand-over's fetch taking its bytes at
  `--sim-kv-load-gbps`; colocated = 2 mixed, disaggregated = 1 prefill + 1 decode. Every
  process of the stack shares this machine's cores, so the client-side ITL includes the
  gateway's and the client's own CPU time per chunk: with 32 streams (~5,500 chunks/s) two
  shared cores no longer keep up and chunks arrive in bursts. Each worker's mean step time in
  each window (its skiff_worker_step_seconds) is printed next to the client's ITL.

Ratio lines (per part): `ITL p99 ratio colocated / disaggregated`, `ITL p99 disaggregated /
idle` (the disaggregated stack's loaded over its idle window; target <= 1.5), `short-prompt
throughput disaggregated / colocated` (loaded windows; target >= 0.95); then `KV transfer /
loopback` (target >= 0.5) and `output differences`. Writes bench/results/pd.json (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.http_client import ClientSession, client_session, sse_chunks  # noqa: E402
from bench.kv_tiers import cpu_model, scrape  # noqa: E402
from bench.long_prompts import corpus, cut_prompts, percentiles  # noqa: E402
from bench.served import greedy_stream_body, start_or_show_logs  # noqa: E402
from services.gateway.config import GatewayConfig  # noqa: E402
from services.launcher import Stack, StackConfig, free_port  # noqa: E402
from services.scheduler.config import SchedulerServiceConfig  # noqa: E402
from services.worker.config import SIM_DEVICE, RunnerConfig, SimConfig  # noqa: E402
from services.worker.kv_transfer import TcpTransport, TransferServer  # noqa: E402
from services.worker.kv_transfer.bench import BLOCK_BYTES, ArraySource  # noqa: E402
from services.worker.kv_transfer.loopback import loopback_bandwidth  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from shared.config import SchedulerConfig  # noqa: E402
from shared.wire import KV_DEVICE, BatchPlan, KVLoad  # noqa: E402

Metrics = dict[str, float]  # a Prometheus page's samples (bench/kv_tiers.py's parse_metrics)
SERVED_NAME = "bench"
MODES = ("colocated", "disaggregated")
PARTS = ("cpu", "sim")
STEADY_PROMPT_TOKENS = 32


@dataclass(frozen=True)
class Workload:
    """One part's requests: `steady` closed-loop streams of `steady_max_tokens` each, alone for
    `idle_s`, then the long prompts, one every `every_s` seconds."""

    steady: int
    steady_max_tokens: int
    idle_s: float
    long_tokens: tuple[int, ...]
    long_max_tokens: int
    every_s: float
    stall_s: float = 600.0  # fail the mode when the long prompts take longer than this in all
    disaggregation_threshold: int = 512  # the scheduler's (its default)

    @property
    def warm_up_tokens(self) -> int:
        """The warm-up's long prompt: above the threshold, so that a disaggregated stack makes
        a hand-over before the workload."""
        return self.disaggregation_threshold + 128


CPU_FULL = Workload(8, 256, 15.0, (2048, 1024, 2048, 1024), 16, 4.0)
# quick: prompts just over a lowered threshold, so that a colocated prefill takes seconds
CPU_QUICK = Workload(2, 16, 1.0, (96, 112), 4, 0.3, 120.0, disaggregation_threshold=64)
SIM_FULL = Workload(16, 1024, 10.0, (8000,) * 6, 32, 2.0)
SIM_QUICK = Workload(8, 64, 1.0, (1024, 1024), 8, 0.3, 60.0)


@dataclass
class Stream:
    """One streamed completion: when it was sent, the time of each chunk carrying a choice,
    its text, and the completion tokens its usage reported (0: it was cut off)."""

    sent: float
    stamps: list[float] = field(default_factory=list)
    text: str = ""
    tokens: int = 0


async def stream_completion(
    client: ClientSession, url: str, prompt: list[int], max_tokens: int, out: Stream
) -> None:
    """A greedy streamed completion, recorded into `out` as its chunks arrive."""
    body = greedy_stream_body(SERVED_NAME, prompt, max_tokens)
    parts: list[str] = []
    async with client.post(f"{url}/v1/completions", json=body) as resp:
        async for chunk in sse_chunks(resp):
            for choice in chunk.get("choices") or []:
                out.stamps.append(time.perf_counter())
                parts.append(choice.get("text") or "")
            if chunk.get("usage"):
                out.tokens = chunk["usage"]["completion_tokens"]
    out.text = "".join(parts)


async def steady_loop(
    client: ClientSession, url: str, prompt: list[int], max_tokens: int, done: list[Stream]
) -> None:
    """Stream `prompt` again and again until cancelled (closing a stream aborts it)."""
    while True:
        stream = Stream(time.perf_counter())
        done.append(stream)
        await stream_completion(client, url, prompt, max_tokens, stream)


def window_gaps(streams: list[Stream], since: float, until: float) -> list[float]:
    """Inter-chunk gaps of each stream whose both ends lie within [since, until]."""
    return [
        b - a for s in streams for a, b in itertools.pairwise(s.stamps) if a >= since and b <= until
    ]


def tokens_per_chunk(streams: list[Stream]) -> float:
    """Completion tokens per chunk of the streams that ended (1.0 when each token came in a
    chunk of its own; a token without text yet waits for the next chunk)."""
    ended = [s for s in streams if s.tokens]
    chunks = sum(len(s.stamps) for s in ended)
    return sum(s.tokens for s in ended) / chunks if chunks else 1.0


def window_tokens_per_s(
    streams: list[Stream], since: float, until: float, per_chunk: float
) -> float:
    """Output tokens/s of `streams` within [since, until]: their chunks there, in tokens."""
    chunks = sum(since <= t <= until for s in streams for t in s.stamps)
    return chunks * per_chunk / (until - since) if until > since else 0.0


@dataclass
class Phases:
    """What one mode's workload recorded: the steady streams, the long ones, and the windows
    (perf_counter times)."""

    steady: list[Stream]
    long: list[Stream]
    idle: tuple[float, float]
    loaded: tuple[float, float]
    worker_step_s: dict[str, dict[str, float]]  # worker -> window -> mean step seconds
    scrape_before: Metrics  # at the start of the idle window

    def summary(self) -> dict[str, Any]:
        per_chunk = tokens_per_chunk(self.steady)
        idle, loaded = self.idle, self.loaded
        return {
            "itl_idle_s": percentiles(window_gaps(self.steady, *idle)),
            "itl_loaded_s": percentiles(window_gaps(self.steady, *loaded)),
            "long_ttft_s": percentiles([s.stamps[0] - s.sent for s in self.long]),
            "steady_tokens_per_s_idle": window_tokens_per_s(self.steady, *idle, per_chunk),
            "steady_tokens_per_s_loaded": window_tokens_per_s(self.steady, *loaded, per_chunk),
            "steady_tokens_per_chunk": per_chunk,
            "idle_window_s": idle[1] - idle[0],
            "loaded_window_s": loaded[1] - loaded[0],
            "long_completion_tokens": [s.tokens for s in self.long],
            "worker_step_mean_s": self.worker_step_s,
        }


async def run_phases(
    client: ClientSession,
    url: str,
    w: Workload,
    steady: list[list[int]],
    long: list[list[int]],
    scrape_all: Callable[[], Metrics],
) -> Phases:
    """The steady streams alone for `idle_s`, then with the long prompts until the last ends;
    `scrape_all` at the start and end of each window."""
    streams: list[list[Stream]] = [[] for _ in steady]
    loops = [
        asyncio.create_task(steady_loop(client, url, p, w.steady_max_tokens, s))
        for p, s in zip(steady, streams, strict=True)
    ]
    long_streams = [Stream(0.0) for _ in long]
    scrapes = []
    try:
        while not all(s and s[0].stamps for s in streams):
            for task in loops:
                if task.done():
                    task.result()  # raises what the stream raised
            await asyncio.sleep(0.01)
        idle_start = time.perf_counter()
        scrapes.append(await asyncio.to_thread(scrape_all))
        await asyncio.sleep(w.idle_s)
        loaded_start = time.perf_counter()
        scrapes.append(await asyncio.to_thread(scrape_all))

        async def send(i: int) -> None:
            await asyncio.sleep(max(0.0, loaded_start + i * w.every_s - time.perf_counter()))
            long_streams[i].sent = time.perf_counter()
            await stream_completion(client, url, long[i], w.long_max_tokens, long_streams[i])

        await asyncio.wait_for(asyncio.gather(*(send(i) for i in range(len(long)))), w.stall_s)
        loaded_end = time.perf_counter()
        scrapes.append(await asyncio.to_thread(scrape_all))
        for task in loops:
            if task.done():
                task.result()
    finally:
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
    return Phases(
        [s for ss in streams for s in ss],
        long_streams,
        (idle_start, loaded_start),
        (loaded_start, loaded_end),
        step_means(scrapes),
        scrapes[0],
    )


def step_means(scrapes: list[Metrics]) -> dict[str, dict[str, float]]:
    """Each worker's mean step time (its skiff_worker_step_seconds) in the idle and the loaded
    window, from the scrapes at their bounds."""
    means: dict[str, dict[str, float]] = {}
    for window, (a, b) in zip(("idle", "loaded"), itertools.pairwise(scrapes), strict=True):
        for key, total in b.items():
            if not key.startswith("skiff_worker_step_seconds_sum{"):
                continue
            worker = key.partition("worker_id=")[2].split(",")[0].rstrip("}")
            count_key = key.replace("_sum{", "_count{")
            steps = b.get(count_key, 0.0) - a.get(count_key, 0.0)
            seconds = total - a.get(key, 0.0)
            means.setdefault(worker, {})[window] = seconds / steps if steps else 0.0
    return means


@contextlib.contextmanager
def env(**values: str) -> Iterator[None]:
    """These environment variables while the block runs (the stack's processes inherit them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def pin(pid: int, cpu: int) -> None:
    """Every thread of process `pid` on core `cpu` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), {cpu})


def stack_config(
    part: str, mode: str, model_dir: str, log_dir: Path, disaggregation_threshold: int = 512
) -> StackConfig:
    """Two workers: both mixed (colocated), or a prefill and a decode worker."""
    split = int(mode == "disaggregated")  # worker-0 prefills, worker-1 decodes
    runner = RunnerConfig(model_dir, device=SIM_DEVICE if part == "sim" else "cpu")
    return StackConfig(
        runner,
        GatewayConfig(served_model_name=SERVED_NAME, port=free_port()),
        scheduler=SchedulerConfig(disaggregation_threshold=disaggregation_threshold),
        scheduler_service=SchedulerServiceConfig(metrics_port=free_port()),
        sim=SimConfig(),
        workers=2,
        worker_http_port=free_port(),
        prefill_workers=split,
        decode_workers=split,
        log_dir=str(log_dir),
    )


@dataclass
class ModeResult:
    part: str
    mode: str
    summary: dict[str, Any]
    metrics: dict[str, float]  # counters' growth over the workload
    long_texts: list[str]


KEPT_METRICS = (
    "skiff_pd_",
    "skiff:kv_load_bytes",
    "skiff:kv_load_seconds",
    "skiff:kv_load_failures",
)


def grew(before: Metrics, after: Metrics) -> Metrics:
    """The hand-over and KV-load counters' growth between two scrapes."""
    return {
        k: v - before.get(k, 0.0)
        for k, v in after.items()
        if k.startswith(KEPT_METRICS) and "_bucket" not in k and "_created" not in k
    }


def run_mode(
    part: str,
    mode: str,
    w: Workload,
    model_dir: str,
    steady: list[list[int]],
    long: list[list[int]],
    warm: list[int],
    log_dir: Path,
) -> ModeResult:
    """Start the mode's stack, warm it up, run the workload, scrape the counters, stop."""
    config = stack_config(part, mode, model_dir, log_dir, w.disaggregation_threshold)
    stack = Stack(config)
    with env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"):
        start_or_show_logs(stack, log_dir)
    try:
        if part == "cpu":
            cores = sorted(os.sched_getaffinity(0))
            for i in range(config.workers):
                pin(stack.procs[f"worker-{i}"].pid, cores[i % len(cores)])
        wait_workers(config.scheduler_service.metrics_port, config.workers)
        # the simulated workers share one process, and its page
        worker_pages = config.workers if part == "cpu" else 1
        pages = [f"http://127.0.0.1:{config.scheduler_service.metrics_port}/metrics"]
        pages += [
            f"http://127.0.0.1:{config.worker_http_port + i}/metrics" for i in range(worker_pages)
        ]

        def scrape_all() -> Metrics:
            return {k: v for page in pages for k, v in scrape(page).items()}

        async def run() -> Phases:
            async with client_session(timeout_s=None) as client:
                await asyncio.gather(  # both workers, and a hand-over when disaggregated
                    *(
                        stream_completion(client, stack.url, prompt, 4, Stream(0.0))
                        for prompt in (steady[0], steady[-1], warm)
                    )
                )
                return await run_phases(client, stack.url, w, steady, long, scrape_all)

        phases = asyncio.run(run())
        time.sleep(1.5)  # the scheduler's counters follow its cores' stats
        metrics = grew(phases.scrape_before, scrape_all())
    finally:
        stack.stop()
    return ModeResult(part, mode, phases.summary(), metrics, [s.text for s in phases.long])


def wait_workers(metrics_port: int, n: int, timeout_s: float = 300.0) -> None:
    """Until the scheduler has `n` ready workers: a stack is up with its first, and requests
    sent before the others are would all go to it (to a prefill worker, with no other)."""
    deadline = time.monotonic() + timeout_s
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    while scrape(url).get("skiff_workers_ready", 0.0) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {n} workers ready after {timeout_s:.0f} s")
        time.sleep(0.5)


def transfer_path_bandwidth(repeats: int = 3, num_blocks: int = 64) -> float:
    """Bytes/s of the KV-transfer path alone: fetches of `num_blocks` SmolLM2 blocks from a
    TransferServer in this process, each block copied out (median of `repeats`)."""
    blocks = np.random.default_rng(0).integers(0, 256, (num_blocks, BLOCK_BYTES), dtype=np.uint8)
    dst = np.empty_like(blocks)  # [num_blocks, block_bytes]

    def copy(i: int, payload: memoryview) -> None:
        dst[i] = np.frombuffer(payload, dtype=np.uint8)

    server = TransferServer(ArraySource(blocks), "bench")
    server.start()
    transport = TcpTransport()
    rates = []
    try:
        for _ in range(repeats + 1):  # the first warms up
            start = time.perf_counter()
            moved = transport.fetch(
                server.address, "bench", "host", list(range(num_blocks)), BLOCK_BYTES, copy
            )
            rates.append(moved / (time.perf_counter() - start))
    finally:
        transport.close()
        server.close()
    return statistics.median(rates[1:])


def runner_transfer_bandwidth(model_dir: str, repeats: int = 3, num_blocks: int = 128) -> float:
    """Bytes/s of a real worker's fetch, with no step running: `num_blocks` device blocks of
    one SmolLM2 ModelRunner fetched by another (gather, TCP, checksums, scatter into the pool),
    both in this process (median of `repeats`)."""
    config = RunnerConfig(model_dir=model_dir, num_blocks=num_blocks)
    source, dest = ModelRunner(config, worker_id="a"), ModelRunner(config, worker_id="b")
    server = TransferServer(source.kv_tiers.block_source(), "a")
    server.start()
    rates = []
    try:
        for step in range(repeats + 1):  # the first warms up
            ids = list(range(num_blocks))
            load = KVLoad(
                load_id=step,
                block_ids=ids,
                src_tier=KV_DEVICE,
                src=ids,
                remote_address=server.address,
                remote_instance_id="a",
            )
            out = dest.execute(BatchPlan(step_id=step, kv_loads=[load]))
            assert out.kv_loads_done == [step], "the fetch failed"
            rates.append(out.kv_load_bytes / out.kv_load_s)
    finally:
        server.close()
        source.close()
        dest.close()
    return statistics.median(rates[1:])


def transfer(disaggregated: ModeResult, loopback_bps: float, path_bps: float) -> dict[str, float]:
    """The decode worker's fetches in the disaggregated CPU mode: bytes and the loader's
    seconds on them (its own counters), and their rate against loopback TCP; the hand-overs'
    seconds (the scheduler's histogram: from a hand-over until the KV is in place, waits for
    room and plans included) for comparison."""
    m = disaggregated.metrics

    def remote(name: str) -> float:
        return sum(v for k, v in m.items() if k.startswith(f"{name}{{") and "source=remote" in k)

    num_bytes = remote("skiff:kv_load_bytes_total")
    seconds = remote("skiff:kv_load_seconds_total")
    rate = num_bytes / seconds if seconds else 0.0
    return {
        "bytes": num_bytes,
        "fetch_seconds": seconds,
        "handoff_seconds": m.get("skiff_pd_transfer_seconds_sum", 0.0),
        "handoffs": m.get("skiff_pd_transfer_seconds_count", 0.0),
        "bytes_per_s": rate,
        "loopback_bytes_per_s": loopback_bps,
        "transfer_path_bytes_per_s": path_bps,
        "ratio": rate / loopback_bps,
        "path_ratio": path_bps / loopback_bps,
    }


def handoffs(metrics: dict[str, float]) -> dict[str, float]:
    return {
        outcome: metrics.get(f"skiff_pd_handoffs_total{{outcome={outcome}}}", 0.0)
        for outcome in ("transferred", "recomputed", "local")
    }


def mode_line(r: ModeResult) -> str:
    s, ms = r.summary, 1e3
    idle, loaded, ttft = s["itl_idle_s"], s["itl_loaded_s"], s["long_ttft_s"]
    h = handoffs(r.metrics)
    return (
        f"{r.part:<4} {r.mode:<13} {idle.get('p50', 0) * ms:>8.1f} {idle.get('p99', 0) * ms:>8.1f} "
        f"{loaded.get('p50', 0) * ms:>8.1f} {loaded.get('p99', 0) * ms:>8.1f} "
        f"{ttft.get('p50', 0):>9.2f} {ttft.get('p99', 0):>9.2f} "
        f"{s['steady_tokens_per_s_idle']:>9.1f} {s['steady_tokens_per_s_loaded']:>9.1f} "
        f"{h['transferred']:.0f}/{h['recomputed']:.0f}/{h['local']:.0f}"
    )


def step_line(r: ModeResult) -> str:
    """Each worker's mean step time, idle -> loaded: where the loaded ITL comes from."""
    steps = r.summary["worker_step_mean_s"]
    means = ", ".join(
        f"{w} {s.get('idle', 0) * 1e3:.0f} -> {s.get('loaded', 0) * 1e3:.0f}"
        for w, s in sorted(steps.items())
    )
    return f"{r.part} {r.mode} worker steps, mean ms idle -> loaded: {means}"


TABLE_HEAD = (
    f"{'part':<4} {'mode':<13} {'ITL idle':>8} {'p99 ms':>8} {'ITL load':>8} {'p99 ms':>8} "
    f"{'TTFT p50':>9} {'p99 s':>9} {'tok/s idl':>9} {'tok/s ld':>9} handoffs t/r/l"
)


def part_ratio_lines(part: str, colocated: ModeResult, disaggregated: ModeResult) -> list[str]:
    """The three ratios of one part, labelled with it."""
    c, d = colocated.summary, disaggregated.summary
    d_p99 = d["itl_loaded_s"].get("p99", 0.0)
    idle_p99 = d["itl_idle_s"].get("p99", 0.0)
    c_tps = c["steady_tokens_per_s_loaded"]

    def ratio(a: float, b: float) -> float:
        return a / b if b else float("inf")

    return [
        f"{part}: ITL p99 ratio colocated / disaggregated: "
        f"{ratio(c['itl_loaded_s'].get('p99', 0.0), d_p99):.2f}",
        f"{part}: ITL p99 disaggregated / idle: {ratio(d_p99, idle_p99):.2f}",
        f"{part}: short-prompt throughput disaggregated / colocated: "
        f"{ratio(d['steady_tokens_per_s_loaded'], c_tps):.2f}",
    ]


def output_differences(colocated: list[str], disaggregated: list[str]) -> int:
    """Long prompts whose greedy text differs between the modes (a missing one counts)."""
    return sum(a != b for a, b in itertools.zip_longest(colocated, disaggregated))


def workloads(quick: bool) -> dict[str, Workload]:
    return {"cpu": CPU_QUICK, "sim": SIM_QUICK} if quick else {"cpu": CPU_FULL, "sim": SIM_FULL}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (the test's)")
    p.add_argument("--parts", default=",".join(PARTS), help="cpu, sim or both")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "pd.json"))
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    if not parts or set(parts) - set(PARTS):
        p.error(f"--parts: some of {', '.join(PARTS)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the stacks on the way out
    from services.worker.gguf_convert import ensure_default_model
    from shared.tokenizer import Tokenizer

    model_dir = ensure_default_model()
    tokens = corpus(Tokenizer(model_dir))
    cpu = cpu_model()
    print(f"CPU model: {cpu}, {len(os.sched_getaffinity(0))} cores", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="skiff-bench-pd-"))
    print(f"service logs: {logs}", flush=True)
    results: dict[str, dict[str, ModeResult]] = {}
    for part in parts:
        w = workloads(args.quick)[part]
        steady = cut_prompts(tokens, [STEADY_PROMPT_TOKENS] * w.steady, seed=3)
        long = cut_prompts(tokens, list(w.long_tokens), seed=1)
        # cut apart from the long prompts, whose prefixes it must not cache
        warm = cut_prompts(tokens, [w.warm_up_tokens], seed=5)[0]
        print(f"{part}: {asdict(w)}", flush=True)
        for mode in MODES:
            t0 = time.perf_counter()
            results.setdefault(part, {})[mode] = run_mode(
                part, mode, w, str(model_dir), steady, long, warm, logs / f"{part}-{mode}"
            )
            print(f"{part} {mode}: {time.perf_counter() - t0:.0f} s", flush=True)
    runs = [r for by_mode in results.values() for r in by_mode.values()]
    lines = [TABLE_HEAD, *map(mode_line, runs), *map(step_line, runs)]
    for part, by_mode in results.items():
        lines += part_ratio_lines(part, by_mode["colocated"], by_mode["disaggregated"])
    report: dict[str, Any] = {}
    if "cpu" in results:
        cpu_modes = results["cpu"]
        kv = transfer(cpu_modes["disaggregated"], loopback_bandwidth(), transfer_path_bandwidth())
        differences = output_differences(
            cpu_modes["colocated"].long_texts, cpu_modes["disaggregated"].long_texts
        )
        handoff_ms = kv["handoff_seconds"] / kv["handoffs"] * 1e3 if kv["handoffs"] else 0.0
        decode_step_ms = (
            cpu_modes["disaggregated"].summary["worker_step_mean_s"].get("worker-1", {})
        ).get("loaded", 0.0) * 1e3
        lines += [
            f"KV transfer: {kv['bytes'] / 1e6:.1f} MB in {kv['handoffs']:.0f} hand-overs, "
            f"{kv['bytes_per_s'] / 1e9:.3f} GB/s over the loader's {kv['fetch_seconds']:.2f} s "
            f"(a hand-over until its KV is in place: mean {handoff_ms:.0f} ms, the decode "
            f"worker's mean step {decode_step_ms:.0f} ms); loopback TCP "
            f"{kv['loopback_bytes_per_s'] / 1e9:.2f} GB/s",
            f"KV transfer path alone / loopback: {kv['path_ratio']:.2f} "
            f"({kv['transfer_path_bytes_per_s'] / 1e9:.2f} GB/s)",
        ]
        if not args.quick:  # two more model loads, in this process
            runner_bps = runner_transfer_bandwidth(str(model_dir))
            kv["runner_bytes_per_s"] = runner_bps
            lines.append(
                "KV transfer runner to runner, no step running / loopback: "
                f"{runner_bps / kv['loopback_bytes_per_s']:.2f} ({runner_bps / 1e9:.2f} GB/s)"
            )
        lines += [
            f"KV transfer / loopback: {kv['ratio']:.2f}",
            f"long prompts compared: {len(cpu_modes['colocated'].long_texts)}",
            f"output differences: {differences}",
        ]
        report.update(kv_transfer=kv, output_differences=differences)
    print("\n".join(lines))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "command": shlex.join(["python", "-m", "bench.pd", *(argv or sys.argv[1:])]),
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "workloads": {part: asdict(workloads(args.quick)[part]) for part in parts},
        "modes": {
            part: {
                mode: {**r.summary, "handoffs": handoffs(r.metrics), "metrics": r.metrics}
                for mode, r in by_mode.items()
            }
            for part, by_mode in results.items()
        },
        **report,
        "lines": lines,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
