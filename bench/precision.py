"""Precision side by side: skiff's CPU weight formats against llama.cpp's GGUF types, on the
same prompts.

    python -m bench.precision [--requests 32] [--rounds 3] [--llama-cpp-threads 2]

- skiff: `fp32`, `bf16`, `bf16_dot`, `int8`, `q8_0` (`--cpu-weights`, bench/cpu_step.py's
  engines): `bf16_dot` and `q8_0` round the activations as llama.cpp's BF16 and Q8_0 do;
- llama.cpp: F32, BF16 (only where the CPU has avx512_bf16) and Q8_0 GGUFs of the same model,
  written by its own `convert_hf_to_gguf.py` (cached beside the F32 one, bench/llamacpp.py).

For each: single-stream decode tok/s (skiff: `decode_only`, its decode steps after a 16-token
prompt; llama.cpp: `llama-bench` tg64, the best of the thread counts), the engines taking turns
`--rounds` times and each keeping its best (the memory bandwidth a decode step is bound by
drifts); greedy agreement with the same engine's fp32 on cpu_step's two prompt sets
(`prompt_sets`, counted by `agreement`), llama.cpp's through `llama-server` `/completion` (one
slot, one request at a time); and llama.cpp F32's agreement with skiff fp32, a sanity line.
Prints the table and the ratio lines, `bf16 speed vs llama.cpp BF16: X.XX (...)` and
`int8 speed vs llama.cpp Q8_0: X.XX (...)` with the agreements next to BF16's and Q8_0's, and
writes bench/results/cpu-precision.md. `make bench` runs it
too (bench/bench.py; `--no-llama-cpp` skips it) and keeps its numbers in its JSON.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import llamacpp, roofline  # noqa: E402
from bench.cpu_step import (  # noqa: E402
    PromptSet,
    agreement,
    build,
    decode_only,
    prompt_sets,
    share,
    tg_prompt,
    timed,
)
from bench.workload import QUESTIONS  # noqa: E402

SKIFF_FORMATS = ("fp32", "bf16", "bf16_dot", "int8", "q8_0")
GGUF_TYPES = {"F32": "f32", "BF16": "bf16", "Q8_0": "q8_0"}  # llama.cpp's name: --outtype
MARKDOWN = ROOT / "bench" / "results" / "cpu-precision.md"
LOG_DIR = Path("/tmp/skiff-bench")

Key = tuple[str, str]  # (engine, precision)
Tokens = list[list[list[int]]]  # per prompt set, per request


def gguf_types(cpu: dict[str, object]) -> tuple[list[str], dict[str, str]]:
    """The llama.cpp types to measure, and why any is left out: BF16 only where the CPU
    computes in it (avx512_bf16)."""
    if cpu.get("avx512_bf16"):
        return list(GGUF_TYPES), {}
    return [t for t in GGUF_TYPES if t != "BF16"], {"BF16": "the CPU has no avx512_bf16"}


@dataclass
class Row:
    """One engine at one precision: decode tok/s and, per prompt set, (tokens before the first
    difference, all tokens) against the same engine's fp32."""

    engine: str
    precision: str
    tok_s: float = 0.0
    agreement: dict[str, tuple[int, int]] = field(default_factory=dict)


def percent(counts: tuple[int, int]) -> str:
    return f"{100 * counts[0] / counts[1]:.1f}%"


@dataclass
class Precision:
    rows: list[Row]
    cross: dict[str, tuple[int, int]]  # llama.cpp F32 against skiff fp32, per prompt set
    skiff_threads: int
    llama_threads: list[int]
    missing: dict[str, str]  # llama.cpp type left out: why

    def row(self, engine: str, precision: str) -> Row | None:
        return next((r for r in self.rows if (r.engine, r.precision) == (engine, precision)), None)

    def report(self) -> list[str]:
        head = f"{'engine':<10} {'precision':<9} {'decode tok/s':>12}  agreement with own fp32"
        lines = [f"{head}: {' / '.join(self.cross)}"]
        for r in self.rows:
            agree = " / ".join(share(c) for c in r.agreement.values())
            lines.append(f"{r.engine:<10} {r.precision:<9} {r.tok_s:>12.1f}  {agree}")
        return lines + self.notes()

    def notes(self) -> list[str]:
        """The sanity line (llama.cpp F32 against skiff fp32) and what was left out."""
        cross = ", ".join(f"{s} {share(c)}" for s, c in self.cross.items())
        left_out = [f"llama.cpp {t} left out: {why}" for t, why in self.missing.items()]
        return [f"llama.cpp F32 against skiff fp32: {cross}", *left_out]

    def ratio_lines(self) -> list[str]:
        """fp32's decode speed over llama.cpp F32's, then the bf16 lines (unless BF16 was
        left out) and the int8 lines: see `peer_lines`."""
        lines = []
        ours, theirs = self.row("skiff", "fp32"), self.row("llama.cpp", "F32")
        if ours and theirs:
            lines.append(f"fp32 speed vs llama.cpp F32: {ours.tok_s / theirs.tok_s:.2f}")
        if "BF16" not in self.missing:
            lines += self.peer_lines("bf16", "bf16_dot", "bf16", "BF16")
        return lines + self.peer_lines("int8", "q8_0", "int8", "Q8_0")

    def peer_lines(self, name: str, rounded: str, fp32_x: str, gguf: str) -> list[str]:
        """The speed line of skiff `rounded` (activations rounded like llama.cpp's `gguf`:
        its peer) over `gguf`'s, with `fp32_x`'s ratio (the same weights, fp32 activations)
        in brackets, and both formats' agreement next to `gguf`'s on each prompt set."""
        ours, other, peer = (
            self.row("skiff", rounded), self.row("skiff", fp32_x), self.row("llama.cpp", gguf)
        )  # fmt: skip
        if not (ours and other and peer):
            return [f"{name} speed vs llama.cpp {gguf} is missing"]
        lines = [
            f"{name} speed vs llama.cpp {gguf}: {ours.tok_s / peer.tok_s:.2f} (skiff {rounded} "
            f"{ours.tok_s:.1f} / {peer.tok_s:.1f} tok/s; skiff {fp32_x} "
            f"{other.tok_s / peer.tok_s:.2f})"
        ]
        for s in self.cross:
            lines.append(
                f"{name} greedy agreement with fp32 vs llama.cpp {gguf}, {s}: skiff {rounded} "
                f"{percent(ours.agreement[s])}, skiff {fp32_x} {percent(other.agreement[s])}, "
                f"llama.cpp {gguf} {percent(peer.agreement[s])}"
            )
        return lines

    def as_json(self) -> dict[str, object]:
        return {
            "rows": [vars(r) for r in self.rows],
            "llama_cpp_f32_vs_skiff_fp32": self.cross,
            "skiff_threads": self.skiff_threads,
            "llama_cpp_threads": self.llama_threads,
            "missing": self.missing,
        }

    def markdown(self, command: str, cpu_line: str) -> str:
        """The table and the ratio lines as bench/results/cpu-precision.md."""
        sets = list(self.cross)
        threads = ",".join(map(str, self.llama_threads))
        lines = [
            "# skiff and llama.cpp at each precision (bench/precision.py)",
            "",
            f"Command: `{command}` ({time.strftime('%Y-%m-%d')}); skiff with "
            f"{self.skiff_threads} threads, llama.cpp `-t {threads}`; load average "
            f"{os.getloadavg()[0]:.1f} at the end (the engines' own threads count in it).",
            f"`{cpu_line}`",
            "",
            "Decode: single stream, tg64 (skiff: its decode steps after a 16-token prompt; "
            "llama.cpp: `llama-bench -p 0 -n 64`), the engines in turns, each its best. "
            "Agreement: tokens before each request's first difference from the same engine's "
            "fp32 (greedy), over all tokens.",
            "",
            f"| engine | precision | decode tok/s | {' | '.join(sets)} |",
            "|---|---|---|" + "---|" * len(sets),
            *(
                f"| {r.engine} | {r.precision} | {r.tok_s:.1f} | "
                + " | ".join(share(r.agreement[s]) for s in sets)
                + " |"
                for r in self.rows
            ),
            "",
            *self.notes(),
            "",
            "```",
            *self.ratio_lines(),
            "```",
        ]
        return "\n".join(lines) + "\n"


def split(flat: list[list[int]], sizes: list[int]) -> Tokens:
    """A flat list of requests' tokens back into consecutive groups of `sizes`."""
    it = iter(flat)
    return [list(itertools.islice(it, n)) for n in sizes]


def llama_tokens(llama: llamacpp.LlamaCpp, sets: list[PromptSet], threads: int) -> Tokens:
    """llama.cpp's greedy tokens of every prompt set, from one llama-server."""
    requests = [
        (p, n, s.ignore_eos) for s in sets for p, n in zip(s.prompts, s.max_tokens, strict=True)
    ]
    log = LOG_DIR / f"llama-server-{llama.gguf.stem}.log"
    flat = llamacpp.greedy_tokens(llama, requests, threads, log)
    return split(flat, [len(s.prompts) for s in sets])


def agreements(
    tokens: Tokens, reference: Tokens, sets: list[PromptSet]
) -> dict[str, tuple[int, int]]:
    return {s.name: agreement(t, r) for s, t, r in zip(sets, tokens, reference, strict=True)}


def take_turns(runs: dict[Key, Callable[[], float]], rounds: int) -> dict[Key, float]:
    """Each run's best of `rounds`, the runs taking turns in their order."""
    best = dict.fromkeys(runs, 0.0)
    for _ in range(rounds):
        for key, measure in runs.items():
            best[key] = max(best[key], measure())
    return best


def interleaved(skiff: list[Key], llama: list[Key]) -> list[Key]:
    """skiff's and llama.cpp's keys alternating, so neither runs all its turns in a row."""
    return [k for pair in itertools.zip_longest(skiff, llama) for k in pair if k]


def tg64(llama: llamacpp.LlamaCpp, threads: list[int]) -> float:
    """llama-bench tg64 tokens/s, the best thread count's."""
    return max(llamacpp.single_stream(llama, threads).values())


def run(
    llama_threads: list[int],
    requests: int = 32,
    rounds: int = 3,
    version: str = llamacpp.LLAMA_CPP_PYTHON_VERSION,
) -> Precision:
    """skiff's engines and llama.cpp's GGUFs (converted first; LlamaCppUnavailable where they
    cannot be), every engine's greedy tokens on the prompt sets, then the decode speeds."""
    import torch

    engines = {f: build(f, max(requests, len(QUESTIONS))) for f in SKIFF_FORMATS}
    fp32 = engines["fp32"]
    types, missing = gguf_types(roofline.cpu_summary())
    model_dir = Path(fp32.runner.config.model_dir)
    ggufs = {t: llamacpp.prepare(model_dir, version, outtype=GGUF_TYPES[t]) for t in types}
    sets = list(prompt_sets(fp32, requests))
    tokens: dict[Key, Tokens] = {
        ("skiff", f): [timed(f, llm, s.prompts, s.params())[1] for s in sets]
        for f, llm in engines.items()
    }
    for t, llama in ggufs.items():
        tokens["llama.cpp", t] = llama_tokens(llama, sets, max(llama_threads))
    prompt = tg_prompt(fp32.tokenizer)
    skiff_runs = {("skiff", f): partial(decode_only, llm, prompt) for f, llm in engines.items()}
    llama_runs = {("llama.cpp", t): partial(tg64, g, llama_threads) for t, g in ggufs.items()}
    runs: dict[Key, Callable[[], float]] = {**skiff_runs, **llama_runs}
    order = interleaved(list(skiff_runs), list(llama_runs))
    speeds = take_turns({k: runs[k] for k in order}, rounds)
    own_fp32 = {"skiff": tokens["skiff", "fp32"], "llama.cpp": tokens["llama.cpp", "F32"]}
    rows = [Row(*k, speeds[k], agreements(tokens[k], own_fp32[k[0]], sets)) for k in tokens]
    cross = agreements(own_fp32["llama.cpp"], own_fp32["skiff"], sets)
    return Precision(rows, cross, torch.get_num_threads(), llama_threads, missing)


def command() -> str:
    """This process's command line, the script relative to the repository."""
    script = Path(sys.argv[0]).resolve()
    path = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(path), *sys.argv[1:]])


def write_markdown(result: Precision, cpu_line: str, out: Path = MARKDOWN) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result.markdown(command(), cpu_line))
    print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32, help="workload requests (agreement)")
    p.add_argument("--rounds", type=int, default=3, help="turns of the decode timing")
    p.add_argument("--llama-cpp-threads", default=str(llamacpp.physical_cores()))
    p.add_argument("--llama-cpp-version", default=llamacpp.LLAMA_CPP_PYTHON_VERSION)
    p.add_argument("--out", default=str(MARKDOWN), help="the markdown results")
    args = p.parse_args()
    cpu_line = roofline.cpu_line()
    print(cpu_line)
    threads = [int(t) for t in args.llama_cpp_threads.split(",")]
    result = run(threads, args.requests, args.rounds, args.llama_cpp_version)
    print("\n".join([*result.report(), *result.ratio_lines()]))
    write_markdown(result, cpu_line, Path(args.out))


if __name__ == "__main__":
    main()
