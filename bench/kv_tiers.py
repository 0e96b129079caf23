"""Tiered KV cache on the served stack: multi-turn chats with the lower KV tiers off, with a
host-memory tier, and with host + local-disk tiers, one stack after another in one run.

    python -m bench.kv_tiers [--conversations 16] [--turns 6] [--think-time 10]
                             [--user-tokens 100,200] [--max-tokens 32] [--seed 0]

Each stack is gateway + scheduler + one CPU worker on the embedded SmolLM2-135M (as
bench/served.py starts it). The workload, the same for every mode: N conversations of T turns
share a short system prompt; each starts with its own user message of random words, and each
turn streams a greedy completion (`max_tokens`, `ignore_eos`) of the whole history as token
ids, then appends the answer (its text, tokenized) and the next user message. Conversations
start at random offsets within one think time and wait a random think time (exponential, mean
`--think-time`) between their turns, so turns of all of them interleave.

The think time sets the load, each conversation sending a turn per think time plus response
time. The default, 10 s, is short for a person who reads a 32-token answer and types 100-200
tokens; with it, 16 conversations are more than 2 cores serve when every turn computes its
whole history, and fewer than they serve when the history is loaded from a tier. With much
shorter think times both modes are overloaded, TTFT is mostly queueing in both, and their
ratio comes down to the throughput ratio (about 2x on 2 cores at 1 s).

The worker's device KV pool holds about a quarter of the live history at the end (the sum of
every conversation's final history, at 45 KiB per token for this model in fp32); the host tier
alone holds all of it, and in host + disk mode the host tier holds half of it and the disk
tier (a file in a temporary directory) the rest. Per mode it prints client-side TTFT p50/p99,
output and prompt tokens/s over the workload's wall time, and hit rates from the scheduler's
/metrics: its device prefix cache's (vllm:prefix_cache_hits / queries) and below it
(vllm:external_prefix_cache_hits / queries), and the prompt tokens loaded from the host tier,
the disk tier and other workers (skiff_kv_tier_hits by origin) per prompt token sent. Every
answer of a tier mode must equal the tiers-off answer to the same conversation and turn
(greedy): `output differences` counts those that do not.

The reference workload is 48 conversations x 6 turns (histories of about 1.1-1.4k tokens):
`python -m bench.kv_tiers --conversations 48` (about three times as long as the default).
Writes bench/results/kv-tiers.json (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import re
import shlex
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.http_client import ClientSession, client_session, sse_chunks  # noqa: E402
from bench.served import greedy_stream_body, start_or_show_logs  # noqa: E402
from bench.workload import CORPUS, TokenEncoder  # noqa: E402
from services.gateway.config import GatewayConfig  # noqa: E402
from services.launcher import Stack, StackConfig, free_port  # noqa: E402
from services.scheduler.config import SchedulerServiceConfig  # noqa: E402
from services.worker.config import RunnerConfig  # noqa: E402

BLOCK_SIZE = 16  # tokens per KV block (the worker's default)
# SmolLM2-135M in fp32: 30 layers x (K + V) x 3 KV heads x 64 dims x 4 bytes = 46,080 per token
BYTES_PER_TOKEN = 46_080
BLOCK_BYTES = BLOCK_SIZE * BYTES_PER_TOKEN  # 737,280
GIB = 1 << 30
SYSTEM_PROMPT = (
    "You are a helpful assistant in a long conversation. Answer the user's latest message "
    "briefly, stay on topic, and keep in mind everything that was said before."
)
MODES = ("off", "host", "host+disk")
SERVED_NAME = "bench"


@dataclass(frozen=True)
class ChatWorkload:
    """The conversations: a shared system prompt, each one's user messages (one per turn),
    start offsets and think times (s), all drawn from one seed."""

    system: list[int]
    messages: list[list[list[int]]]  # [conversation][turn] -> token ids
    starts: list[float]  # [conversation]
    think: list[list[float]]  # [conversation][turn]: the pause before that turn (0 for the first)
    max_tokens: int

    @property
    def num_turns(self) -> int:
        return len(self.messages[0])

    def final_history_tokens(self) -> list[int]:
        """Each conversation's history after its last answer, answers taken at max_tokens."""
        return [
            len(self.system) + sum(map(len, msgs)) + len(msgs) * self.max_tokens
            for msgs in self.messages
        ]


def chat_workload(
    tokenizer: TokenEncoder,
    conversations: int,
    turns: int,
    user_tokens: tuple[int, int] = (100, 200),
    max_tokens: int = 32,
    think_time: float = 10.0,
    seed: int = 0,
) -> ChatWorkload:
    """User messages of random corpus words, cut to a length drawn from `user_tokens`."""
    rng = random.Random(seed)
    words = CORPUS.split()
    lo, hi = user_tokens

    def message() -> list[int]:
        n = rng.randint(lo, hi)
        text = " " + " ".join(rng.choice(words) for _ in range(n))  # more words than tokens
        return tokenizer.encode(text, add_special_tokens=False)[:n]

    messages = [[message() for _ in range(turns)] for _ in range(conversations)]
    starts = [rng.uniform(0.0, think_time) for _ in range(conversations)]

    def pause() -> float:
        return rng.expovariate(1.0 / think_time) if think_time > 0 else 0.0

    think = [[0.0] + [pause() for _ in range(1, turns)] for _ in range(conversations)]
    system = tokenizer.encode(SYSTEM_PROMPT, add_special_tokens=False)
    return ChatWorkload(system, messages, starts, think, max_tokens)


def blocks_gib(blocks: int) -> float:
    return blocks * BLOCK_BYTES / GIB


@dataclass(frozen=True)
class TierSizes:
    """KV capacity of each mode, in blocks of BLOCK_BYTES."""

    live_blocks: int  # the live history at the end
    device_blocks: int
    host_blocks: int  # host mode
    split_host_blocks: int  # host + disk mode
    split_disk_blocks: int

    def runner(self, mode: str, model_dir: str, disk_path: str) -> RunnerConfig:
        """The worker's settings in `mode`."""
        tiers: dict[str, Any] = {}
        if mode == "host":
            tiers = {"kv_offloading_size": blocks_gib(self.host_blocks)}
        elif mode == "host+disk":
            tiers = {
                "kv_offloading_size": blocks_gib(self.split_host_blocks),
                "kv_offloading_disk_size": blocks_gib(self.split_disk_blocks),
                "kv_offloading_disk_path": disk_path,
            }
        return RunnerConfig(model_dir, kv_cache_gib=blocks_gib(self.device_blocks), **tiers)


def tier_sizes(workload: ChatWorkload) -> TierSizes:
    """Device pool: a quarter of the live history, never less than the longest request needs;
    lower tiers: all of it with a quarter to spare (host), or half on host and the rest on disk.
    """
    finals = workload.final_history_tokens()
    live = sum(math.ceil(n / BLOCK_SIZE) for n in finals)
    longest = math.ceil(max(finals) / BLOCK_SIZE) + 1
    lower = math.ceil(live * 1.25)
    half = math.ceil(live / 2)
    return TierSizes(live, max(math.ceil(live / 4), longest), lower, half, lower - half)


@dataclass
class Turn:
    """One streamed completion: what it sent, when its first token came, what it got."""

    conversation: int
    turn: int
    prompt_tokens: int
    ttft_s: float
    completion_tokens: int
    text: str


class Stalled(RuntimeError):
    """No stream got a token for too long: the stack stopped making progress. `turns`: those
    that finished before."""

    def __init__(self, message: str, turns: list[Turn]) -> None:
        super().__init__(message)
        self.turns = turns


@dataclass
class Progress:
    """When any stream last got a chunk, and the turns finished."""

    last: float = field(default_factory=time.perf_counter)
    done: list[Turn] = field(default_factory=list)


async def stream_turn(
    client: ClientSession,
    url: str,
    prompt: list[int],
    max_tokens: int,
    progress: Progress | None = None,
) -> tuple[float, int, str]:
    """One greedy streamed completion: its TTFT, completion tokens (usage) and text."""
    body = greedy_stream_body(SERVED_NAME, prompt, max_tokens)
    start = time.perf_counter()
    first = 0.0
    tokens = 0
    parts: list[str] = []
    async with client.post(f"{url}/v1/completions", json=body) as resp:
        async for chunk in sse_chunks(resp):
            if progress is not None:
                progress.last = time.perf_counter()
            for choice in chunk.get("choices") or []:
                if not first:
                    first = time.perf_counter()
                parts.append(choice.get("text") or "")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first - start, tokens, "".join(parts)


async def converse(
    client: ClientSession,
    url: str,
    tokenizer: TokenEncoder,
    workload: ChatWorkload,
    index: int,
    progress: Progress,
) -> None:
    """Conversation `index`, turn after turn, each with the whole history as its prompt."""
    await asyncio.sleep(workload.starts[index])
    history = list(workload.system)
    for t, message in enumerate(workload.messages[index]):
        await asyncio.sleep(workload.think[index][t])
        history += message
        ttft, tokens, text = await stream_turn(client, url, history, workload.max_tokens, progress)
        progress.done.append(Turn(index, t, len(history), ttft, tokens, text))
        history += tokenizer.encode(text, add_special_tokens=False)


async def run_workload(
    client: ClientSession,
    url: str,
    tokenizer: TokenEncoder,
    workload: ChatWorkload,
    stall_s: float,
) -> list[Turn]:
    """Every conversation at once; raises Stalled when no stream gets a chunk for `stall_s`."""
    progress = Progress()
    n = len(workload.messages)
    total = n * workload.num_turns
    convs = asyncio.gather(
        *(converse(client, url, tokenizer, workload, i, progress) for i in range(n))
    )
    while True:
        done, _ = await asyncio.wait({convs}, timeout=1.0)
        if done:
            convs.result()  # raises what a conversation raised
            return progress.done
        if time.perf_counter() - progress.last > stall_s:
            convs.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await convs
            stalled = f"no token for {stall_s:.0f} s after {len(progress.done)} of {total} turns"
            raise Stalled(stalled, progress.done)


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of a Prometheus text page: `name` or `name{label=value,...}` (model_name
    dropped) -> value."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        kept = [f"{k}={v}" for k, v in re.findall(r'(\w+)="([^"]*)"', labels) if k != "model_name"]
        key = f"{name}{{{','.join(kept)}}}" if kept else name
        samples[key] = samples.get(key, 0.0) + float(value)
    return samples


def scrape(metrics_url: str) -> dict[str, float]:
    text: str = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return parse_metrics(text)


def hit_rates(
    before: dict[str, float], after: dict[str, float], prompt_tokens: int
) -> dict[str, float]:
    """Hit rates of the workload from the counters' growth between two scrapes: the
    scheduler's own (device prefix cache, and below it) and each lower tier's loads as a share
    of the prompt tokens sent. The scheduler counts a lookup each time it tries to admit a
    request, so a request that waits for room is looked up (and its hits counted) again."""

    def grew(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    def rate(hits: float, of: float) -> float:
        return hits / of if of else 0.0

    queries = grew("vllm:prefix_cache_queries_total")
    external = grew("vllm:external_prefix_cache_queries_total")
    rates = {
        "prefix_cache_queries_tokens": queries,
        "device": rate(grew("vllm:prefix_cache_hits_total"), queries),
        "external_prefix_cache_queries_tokens": external,
        "external": rate(grew("vllm:external_prefix_cache_hits_total"), external),
    }
    for origin in ("host", "disk", "remote"):
        rates[origin] = rate(grew(f"skiff_kv_tier_hits_total{{origin={origin}}}"), prompt_tokens)
    return rates


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


@dataclass
class ModeResult:
    mode: str
    runner: dict[str, Any]
    elapsed_s: float
    turns: list[Turn]
    hits: dict[str, float]
    summary: dict[str, float] = field(init=False)

    def __post_init__(self) -> None:
        ttft = [t.ttft_s for t in self.turns]
        self.summary = {
            "ttft_p50_s": percentile(ttft, 0.5),
            "ttft_p99_s": percentile(ttft, 0.99),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else 0.0,
            "output_tokens_per_s": sum(t.completion_tokens for t in self.turns) / self.elapsed_s,
            "prompt_tokens_per_s": sum(t.prompt_tokens for t in self.turns) / self.elapsed_s,
            "elapsed_s": self.elapsed_s,
        }

    def answers(self) -> dict[tuple[int, int], str]:
        return {(t.conversation, t.turn): t.text for t in self.turns}


def run_mode(
    mode: str,
    workload: ChatWorkload,
    sizes: TierSizes,
    model_dir: str,
    tokenizer: TokenEncoder,
    log_dir: Path,
    stall_s: float,
) -> ModeResult:
    """Start a stack with `mode`'s tiers (its logs under `log_dir`), run the workload once,
    scrape, stop."""
    metrics_port = free_port()
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    with tempfile.TemporaryDirectory(prefix="skiff-kv-disk-") as disk_path:
        runner = sizes.runner(mode, model_dir, disk_path)
        stack = Stack(
            StackConfig(
                runner,
                GatewayConfig(served_model_name=SERVED_NAME, port=free_port()),
                scheduler_service=SchedulerServiceConfig(metrics_port=metrics_port),
                log_dir=str(log_dir),
            )
        )
        start_or_show_logs(stack, log_dir)
        try:

            async def run() -> tuple[float, list[Turn], dict[str, float]]:
                async with client_session(timeout_s=None) as client:
                    await stream_turn(client, stack.url, [1, 2, 3, 4], 4)  # warm-up
                    before = scrape(metrics_url)
                    t0 = time.perf_counter()
                    turns = await run_workload(client, stack.url, tokenizer, workload, stall_s)
                    return time.perf_counter() - t0, turns, before

            try:
                elapsed, turns, before = asyncio.run(run())
            except Stalled as e:
                m = scrape(metrics_url)
                state = (
                    f"; the scheduler then: {m.get('vllm:num_requests_running', 0):.0f} "
                    f"running, {m.get('vllm:num_requests_waiting', 0):.0f} waiting, device KV "
                    f"usage {m.get('vllm:kv_cache_usage_perc', 0):.0%}"
                )
                raise Stalled(f"{e}{state}", e.turns) from None
            time.sleep(1.5)  # the scheduler's counters follow its cores' stats
            prompt_tokens = sum(t.prompt_tokens for t in turns)
            hits = hit_rates(before, scrape(metrics_url), prompt_tokens)
        finally:
            stack.stop()
    fields = ("kv_cache_gib", "kv_offloading_size", "kv_offloading_disk_size")
    return ModeResult(mode, {f: getattr(runner, f) for f in fields}, elapsed, turns, hits)


def output_differences(
    off: dict[tuple[int, int], str], tiered: list[dict[tuple[int, int], str]]
) -> tuple[int, int]:
    """Answers of the tier modes (conversation, turn -> text) that differ from tiers off's,
    and how many were compared (a failed mode's finished turns count)."""
    pairs = [(text, off.get(key)) for answers in tiered for key, text in answers.items()]
    return sum(text != ref for text, ref in pairs), len(pairs)


def ratio_lines(results: dict[str, ModeResult], failures: dict[str, str]) -> list[str]:
    """TTFT p50 of tiers off over each tier mode's; why one is missing when a mode failed."""
    lines = []
    for mode, label in (("host", "on"), ("host+disk", "host+disk")):
        missing = [f"{m} mode {failures[m]}" for m in ("off", mode) if m in failures]
        if missing:
            lines.append(f"TTFT p50 ratio tiers off / {label} is missing: {'; '.join(missing)}")
            continue
        on = results[mode].summary["ttft_p50_s"]
        ratio = results["off"].summary["ttft_p50_s"] / on if on else 0.0
        lines.append(f"TTFT p50 ratio tiers off / {label}: {ratio:.2f}")
    return lines


def table(results: dict[str, ModeResult], failures: dict[str, str]) -> list[str]:
    head = (
        f"{'mode':<10} {'TTFT p50 s':>10} {'TTFT p99 s':>10} {'output tok/s':>12} "
        f"{'prompt tok/s':>12} {'device hit':>10} {'host hit':>8} {'disk hit':>8} "
        f"{'external hit':>12}"
    )
    lines = [head]
    for mode in MODES:
        if mode in failures:
            lines.append(f"{mode:<10} failed: {failures[mode]}")
            continue
        s, h = results[mode].summary, results[mode].hits
        lines.append(
            f"{mode:<10} {s['ttft_p50_s']:>10.3f} {s['ttft_p99_s']:>10.3f} "
            f"{s['output_tokens_per_s']:>12.1f} {s['prompt_tokens_per_s']:>12.1f} "
            f"{h['device']:>10.1%} {h['host']:>8.1%} {h['disk']:>8.1%} {h['external']:>12.1%}"
        )
    return lines


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--think-time", type=float, default=10.0, help="mean pause between turns, s")
    p.add_argument("--user-tokens", default="100,200", help="user message length range")
    p.add_argument("--max-tokens", type=int, default=32, help="answer length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stall-timeout", type=float, default=120.0, help="fail a mode after s without a token"
    )
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv-tiers.json"))
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the stacks on the way out
    from services.worker.gguf_convert import ensure_default_model
    from shared.tokenizer import Tokenizer

    model_dir = ensure_default_model()
    tokenizer = Tokenizer(model_dir)
    lo, hi = (int(n) for n in args.user_tokens.split(","))
    workload = chat_workload(
        tokenizer,
        args.conversations,
        args.turns,
        (lo, hi),
        args.max_tokens,
        args.think_time,
        args.seed,
    )
    sizes = tier_sizes(workload)
    cpu = f"CPU model: {cpu_model()}"
    print(cpu)
    print(
        f"workload: {args.conversations} conversations x {args.turns} turns, live history at "
        f"the end {sizes.live_blocks * BLOCK_SIZE} tokens ({blocks_gib(sizes.live_blocks):.3f} "
        f"GiB); device pool {sizes.device_blocks} blocks ({blocks_gib(sizes.device_blocks):.3f} "
        f"GiB), host tier {blocks_gib(sizes.host_blocks):.3f} GiB, host+disk "
        f"{blocks_gib(sizes.split_host_blocks):.3f} + {blocks_gib(sizes.split_disk_blocks):.3f} "
        "GiB",
        flush=True,
    )
    logs = Path(tempfile.mkdtemp(prefix="skiff-bench-kv-"))
    print(f"service logs: {logs}")
    results: dict[str, ModeResult] = {}
    answers: dict[str, dict[tuple[int, int], str]] = {}  # mode -> its answers, as finished
    failures: dict[str, str] = {}  # mode -> why it has no result
    for mode in MODES:
        log_dir = logs / mode.replace("+", "-")
        try:
            result = run_mode(
                mode, workload, sizes, str(model_dir), tokenizer, log_dir, args.stall_timeout
            )
        except Stalled as e:
            answers[mode] = {(t.conversation, t.turn): t.text for t in e.turns}
            failures[mode] = f"{e} (logs: {log_dir})"
            print(f"{mode}: {failures[mode]}", flush=True)
            continue
        results[mode] = result
        answers[mode] = result.answers()
        print(f"{mode}: {result.elapsed_s:.1f} s", flush=True)
    tiered = [a for m, a in answers.items() if m != "off"]
    differences, compared = output_differences(answers.get("off", {}), tiered)
    lines = [
        *table(results, failures),
        f"answers compared with tiers off: {compared}",
        f"output differences: {differences}",
        *ratio_lines(results, failures),
    ]
    print("\n".join(lines))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "command": shlex.join(["python", "-m", "bench.kv_tiers", *(argv or sys.argv[1:])]),
        "cpu": cpu_model(),
        "workload": {**vars(args), "sizes_blocks": asdict(sizes), "block_bytes": BLOCK_BYTES},
        "modes": {m: {**r.summary, "hits": r.hits, "runner": r.runner} for m, r in results.items()},
        "failed_modes": failures,
        "answers_compared": compared,
        "output_differences": differences,
        "lines": lines,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    if failures or differences:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
