"""Long prompts: prefill speed, and how a long prefill shares a served worker.

    python -m bench.long_prompts [--sizes 512,2048,8000] [--streams 8] [--no-llama-cpp]

- In process (the offline engine, its default token budget, prefix caching off): the time and
  tokens/s of one prompt's prefill (max_tokens=1) at each size.
- Served (a Stack as bench/served.py starts it, prefix caching off; the official `openai`
  client, streaming): time to first token of one prompt alone at each size; inter-token
  latency p50/p99 of `--streams` running streams idle, and while the longest prompt is
  admitted (the gaps between its send and its first token; it is then aborted); the TTFT of
  3-token requests sent every `--short-every` seconds behind the longest prompt alone.
- llama.cpp (bench/llamacpp.py, built once): `llama-bench -p <sizes> -n 0` prefill tokens/s,
  and `llama-server` TTFT at each size through the same client.

Prompts are cut from Python's own library sources at different offsets (varied text, no shared
prefix). `make bench` runs this section too (bench/bench.py); alone it writes
bench/results/long_prompts.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from openai import AsyncOpenAI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import llamacpp, roofline  # noqa: E402
from bench.workload import TokenEncoder  # noqa: E402
from services.gateway.config import GatewayConfig  # noqa: E402
from services.launcher import Stack, StackConfig, free_port  # noqa: E402
from services.worker.config import RunnerConfig  # noqa: E402
from shared.config import SchedulerConfig  # noqa: E402

if TYPE_CHECKING:
    from services.offline import LLM

SIZES = (512, 2048, 8000)  # the longest fits an 8192-token context with its output
CORPUS_MODULES = (
    *("argparse", "asyncio/base_events", "collections/__init__", "dataclasses", "difflib"),
    *("email/message", "inspect", "json/decoder", "logging/__init__", "pathlib", "pydoc"),
    *("shutil", "subprocess", "tarfile", "typing", "zipfile"),
)
SHORT_PROMPT_TOKENS = 3


def label(n: int) -> str:
    """512 -> '512', 2048 -> '2k', 8000 -> '8k'."""
    return str(n) if n < 1024 else f"{round(n / 1024)}k"


def corpus(tokenizer: TokenEncoder) -> list[int]:
    """Tokens of a fixed set of Python library sources: some 300k tokens of varied text."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((lib / f"{m}.py").read_text() for m in CORPUS_MODULES)
    return tokenizer.encode(text, add_special_tokens=False)


def cut_prompts(tokens: list[int], lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts of the given lengths from random, distinct starts of `tokens`."""
    rng = random.Random(seed)
    return [
        tokens[start : start + n] for n in lengths for start in [rng.randrange(0, len(tokens) - n)]
    ]


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": pick(0.5), "p99": pick(0.99), "max": ordered[-1], "n": len(ordered)}


# ---- in process ---------------------------------------------------------------------------


def prefill_times(llm: LLM, prompts: list[list[int]]) -> dict[int, float]:
    """Seconds of each prompt's prefill and first token in the offline engine, by length (best
    of two below 4k tokens, one run above)."""
    from services.offline import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([prompts[0][:64]], params)  # warm-up
    times = {}
    for prompt in prompts:
        runs = []
        for _ in range(2 if len(prompt) < 4096 else 1):
            start = time.perf_counter()
            llm.generate([prompt], params)
            runs.append(time.perf_counter() - start)
        times[len(prompt)] = min(runs)
    return times


# ---- through a server -----------------------------------------------------------------------


async def stream(
    client: AsyncOpenAI,
    model: str,
    prompt: list[int],
    max_tokens: int,
    stamps: list[float],
    extra: dict[str, Any] | None = None,
) -> float:
    """One greedy streamed completion; appends the time of each chunk carrying a choice to
    `stamps` as it arrives; returns its start."""
    start = time.perf_counter()
    chunks = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, **(extra or {})},
    )
    async for chunk in chunks:
        if chunk.choices:
            stamps.append(time.perf_counter())
    return start


async def ttft(
    client: AsyncOpenAI, model: str, prompt: list[int], extra: dict[str, Any] | None = None
) -> float:
    stamps: list[float] = []
    start = await stream(client, model, prompt, 1, stamps, extra)
    return stamps[0] - start


def gaps(stamps: list[float], since: float = 0.0, until: float = float("inf")) -> list[float]:
    """Inter-token gaps whose both ends lie within [since, until]."""
    return [b - a for a, b in itertools.pairwise(stamps) if a >= since and b <= until]


async def streams_itl(
    client: AsyncOpenAI,
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    long_prompt: list[int] | None,
) -> tuple[list[float], float]:
    """ITL of the streams of `prompts`: all their gaps, or with `long_prompt` those between its
    send (once every stream has its first token) and its first token, which then aborts it.
    Returns the gaps and the long prompt's TTFT (0 without one; inf if the streams ended
    first)."""
    stamps: list[list[float]] = [[] for _ in prompts]
    tasks = [
        asyncio.create_task(stream(client, model, p, max_tokens, s))
        for p, s in zip(prompts, stamps, strict=True)
    ]
    if long_prompt is None:
        await asyncio.gather(*tasks)
        return [g for s in stamps for g in gaps(s)], 0.0
    while not all(stamps) and not all(t.done() for t in tasks):
        await asyncio.sleep(0.005)
    long_stamps: list[float] = []
    sent = time.perf_counter()
    long_task = asyncio.create_task(stream(client, model, long_prompt, 1, long_stamps))
    await asyncio.gather(*tasks)
    until = long_stamps[0] if long_stamps else time.perf_counter()
    long_ttft = until - sent if long_stamps else float("inf")
    long_task.cancel()  # closing the stream aborts the request
    await asyncio.gather(long_task, return_exceptions=True)
    return [g for s in stamps for g in gaps(s, sent, until)], long_ttft


async def short_behind_long(
    client: AsyncOpenAI,
    model: str,
    long_prompt: list[int],
    shorts: list[list[int]],
    every_s: float,
) -> list[float]:
    """TTFT of each short prompt, sent one at a time every `every_s` seconds after the long
    prompt (alone before them) while it prefills; the long one is aborted after the last."""
    long_stamps: list[float] = []
    long_task = asyncio.create_task(stream(client, model, long_prompt, 1, long_stamps))
    results = []
    for short in shorts:
        await asyncio.sleep(every_s)
        if long_stamps:
            break  # the long prompt is done: what follows would not be behind it
        results.append(await ttft(client, model, short))
    long_task.cancel()
    await asyncio.gather(long_task, return_exceptions=True)
    return results


@dataclass
class Served:
    """What the served part measured (seconds)."""

    ttft_alone: dict[int, float] = field(default_factory=dict)  # prompt tokens -> TTFT
    itl_idle: dict[str, float] = field(default_factory=dict)
    itl_long: dict[str, float] = field(default_factory=dict)
    long_ttft_with_streams: float = 0.0
    short_ttft_behind_long: dict[str, float] = field(default_factory=dict)


async def served_scenarios(
    url: str,
    model: str,
    prompts: list[list[int]],
    stream_prompts: list[list[int]],
    shorts: list[list[int]],
    stream_tokens: int,
    short_every_s: float,
) -> Served:
    """`prompts`: one per size, the longest last, and two more of the longest size."""
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=1800, max_retries=0)
    async with client:
        await ttft(client, model, stream_prompts[0])  # warm-up
        result = Served()
        *by_size, long_a, long_b = prompts
        for prompt in by_size:
            result.ttft_alone[len(prompt)] = await ttft(client, model, prompt)
        itl, _ = await streams_itl(client, model, stream_prompts, stream_tokens, None)
        result.itl_idle = percentiles(itl)
        itl, long_ttft = await streams_itl(client, model, stream_prompts, stream_tokens, long_a)
        result.itl_long, result.long_ttft_with_streams = percentiles(itl), long_ttft
        short_ttfts = await short_behind_long(client, model, long_b, shorts, short_every_s)
        result.short_ttft_behind_long = percentiles(short_ttfts)
    return result


def run_skiff_served(model_dir: str, **scenario: Any) -> Served:
    """The scenarios on a served stack of the default configuration, prefix caching off."""
    stack = Stack(
        StackConfig(
            RunnerConfig(model_dir=model_dir),
            GatewayConfig(served_model_name="bench", port=free_port()),
            scheduler=SchedulerConfig(enable_prefix_caching=False),
            log_dir="/tmp/skiff-bench",
        )
    )
    stack.start()
    try:
        return asyncio.run(served_scenarios(stack.url, "bench", **scenario))
    finally:
        stack.stop()


def llama_server_ttft(
    llama: llamacpp.LlamaCpp, prompts: list[list[int]], threads: int, warm: list[int]
) -> dict[int, float]:
    """`llama-server` (one slot, prompt cache off) TTFT of each prompt, through the same
    client."""
    port = free_port()
    ctx = llamacpp.ctx_per_slot(prompts, [1] * len(prompts))
    cmd = llamacpp.server_command(llama, port, 1, ctx, threads)
    log = Path("/tmp/skiff-bench") / f"llama-server-long-t{threads}.log"
    no_cache = {"cache_prompt": False}

    async def run(url: str) -> dict[int, float]:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=1800, max_retries=0)
        async with client:
            await ttft(client, "bench", warm, no_cache)
            return {len(p): await ttft(client, "bench", p, no_cache) for p in prompts}

    with llamacpp.LlamaServer(cmd, port, log) as server:
        return asyncio.run(run(server.url))


# ---- the whole section ----------------------------------------------------------------------


@dataclass
class LongPrompts:
    """Every measurement of the section (seconds, tokens/s), for the results JSON and report."""

    sizes: list[int]
    prefill_s: dict[int, float]  # skiff in process
    served: Served | None = None
    llama_prefill_tok_s: dict[int, float] = field(default_factory=dict)  # llama-bench
    llama_ttft: dict[int, float] = field(default_factory=dict)  # llama-server
    llama_missing: str = ""

    @property
    def prefill_tok_s(self) -> dict[int, float]:
        return {n: n / t for n, t in self.prefill_s.items()}

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "prefill_tok_s": self.prefill_tok_s}

    def report(self) -> list[str]:
        """The section's table and served latencies, for the console."""
        lines = [
            f"\n{'prompt tokens':>13} {'prefill tok/s':>13} {'llama-bench':>11} "
            f"{'TTFT served':>11} {'llama-server':>12}"
        ]
        for n in self.sizes:
            ours = self.prefill_tok_s[n]
            theirs = self.llama_prefill_tok_s.get(n)
            served = self.served.ttft_alone.get(n) if self.served else None
            llama_ttft = self.llama_ttft.get(n)
            lines.append(
                f"{n:>13} {ours:>13.1f} {_fmt(theirs, '.1f'):>11} "
                f"{_fmt(served, '.2f', 's'):>11} {_fmt(llama_ttft, '.2f', 's'):>12}"
            )
        s = self.served
        if s:
            longest = self.sizes[-1]
            ratio = s.ttft_alone[longest] / self.prefill_s[longest]
            lines.append(
                f"served TTFT of {longest} tokens alone / in-process prefill: {ratio:.2f} "
                f"({s.ttft_alone[longest]:.2f} s / {self.prefill_s[longest]:.2f} s)"
            )
            idle, busy = s.itl_idle, s.itl_long
            lines.append(
                f"ITL of running streams, idle: p50 {idle['p50'] * 1e3:.1f} ms, p99 "
                f"{idle['p99'] * 1e3:.1f} ms; while a {longest}-token prompt is admitted: "
                f"p50 {busy.get('p50', 0) * 1e3:.1f} ms, p99 {busy.get('p99', 0) * 1e3:.1f} ms "
                f"({busy.get('n', 0)} gaps; p99 ratio {busy.get('p99', 0) / idle['p99']:.2f})"
            )
            short = s.short_ttft_behind_long
            lines.append(
                f"TTFT of {SHORT_PROMPT_TOKENS}-token requests behind a {longest}-token prompt: "
                f"p50 {short.get('p50', 0):.2f} s, max {short.get('max', 0):.2f} s "
                f"({short.get('n', 0)} requests)"
            )
        if self.llama_missing:
            lines.append(f"llama.cpp long prompts missing: {self.llama_missing}")
        return lines

    def ratio_lines(self) -> list[str]:
        """`prefill ratio vs llama.cpp at 2k: X.XX` and at 8k (skiff in-process prefill tok/s
        over llama-bench's), or why each is missing."""
        lines = []
        for n in (2048, SIZES[-1]):
            name = f"prefill ratio vs llama.cpp at {label(n)}"
            theirs = self.llama_prefill_tok_s.get(n)
            if theirs and n in self.prefill_s:
                lines.append(f"{name}: {self.prefill_tok_s[n] / theirs:.2f}")
            else:
                lines.append(f"{name} is missing: {self.llama_missing or 'size not run'}")
        return lines


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def run(
    llm: LLM,
    llama: llamacpp.LlamaCpp | None,
    threads: list[int],
    *,
    sizes: tuple[int, ...] = SIZES,
    served: bool = True,
    streams: int = 8,
    stream_tokens: int = 128,
    shorts: int = 5,
    short_every_s: float = 3.0,
    llama_missing: str = "--no-llama-cpp",
) -> LongPrompts:
    """The whole section with an offline engine already loaded (and llama.cpp when built)."""
    tokens = corpus(llm.tokenizer)
    sizes = tuple(sorted(sizes))
    prompts = cut_prompts(tokens, [*sizes, sizes[-1], sizes[-1]], seed=1)
    result = LongPrompts(list(sizes), prefill_times(llm, cut_prompts(tokens, list(sizes), 2)))
    if served:
        result.served = run_skiff_served(
            llm.runner.config.model_dir,
            prompts=prompts,
            stream_prompts=cut_prompts(tokens, [32] * streams, seed=3),
            shorts=cut_prompts(tokens, [SHORT_PROMPT_TOKENS] * shorts, seed=4),
            stream_tokens=stream_tokens,
            short_every_s=short_every_s,
        )
    if llama is None:
        result.llama_missing = llama_missing
        return result
    try:
        result.llama_prefill_tok_s = llamacpp.prefill(llama, threads, list(sizes))
        if served:
            warm = prompts[0][:32]
            result.llama_ttft = min(
                (llama_server_ttft(llama, prompts[: len(sizes)], t, warm) for t in threads),
                key=lambda r: r[sizes[-1]],
            )
    except llamacpp.LlamaCppUnavailable as e:
        result.llama_missing = f"failed: {e}"
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="prompt tokens")
    p.add_argument("--streams", type=int, default=8, help="running streams for the ITL")
    p.add_argument("--stream-tokens", type=int, default=128, help="tokens of each stream")
    p.add_argument("--shorts", type=int, default=5, help="short requests behind the longest")
    p.add_argument("--short-every", type=float, default=3.0, help="seconds between them")
    p.add_argument("--no-served", dest="served", action="store_false")
    p.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false")
    p.add_argument("--llama-cpp-threads", default=str(llamacpp.physical_cores()))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "long_prompts.json"))
    args = p.parse_args(argv)
    from services.offline import LLM

    llm = LLM(enable_prefix_caching=False)
    cpu = roofline.cpu_line()
    print(cpu)
    llama, missing = None, "--no-llama-cpp"
    if args.llama_cpp:
        try:
            llama = llamacpp.prepare(Path(llm.runner.config.model_dir))
        except llamacpp.LlamaCppUnavailable as e:
            missing = f"cannot be built: {e}"
    result = run(
        llm,
        llama,
        [int(t) for t in args.llama_cpp_threads.split(",")],
        sizes=tuple(int(n) for n in args.sizes.split(",")),
        served=args.served,
        streams=args.streams,
        stream_tokens=args.stream_tokens,
        shorts=args.shorts,
        short_every_s=args.short_every,
        llama_missing=missing,
    )
    for line in [*result.report(), *result.ratio_lines()]:
        print(line)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cpu": cpu, **result.as_json()}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
