"""Structured outputs: the grammar library comparison and the engine's cost.

    python bench/structured.py [--batches 1 32 256] [--max-tokens 24] [--skip-engine]

1. Libraries (llguidance; xgrammar when importable): the tokenizer's set-up, compile time per
   JSON schema, next-token mask time per step for batches of 1, 64 and 256 matchers walking
   their grammars, and resident memory added by the tokenizer, compiled grammars and matchers.
2. Engine: the offline engine on the embedded SmolLM2 (CPU), JSON-schema-constrained vs
   unconstrained generation at each batch size (same tokens per request: the schema cannot
   finish within max_tokens), with the mask's share of a decode step (fill on the CPU and the
   sampler's apply), and the fill set against the 5 ms simulated GPU step of bench/scale.py.

Results as markdown on stdout (bench/results/structured.md keeps a run).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar

import numpy as np

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from services.worker.model_runner import ModelRunner
    from shared.wire import BatchPlan, ModelRunnerOutput

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 32},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z]+\\.[a-z]{2,4}$"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                        "price": {"type": "number", "minimum": 0},
                        "kind": {"enum": ["book", "food", "tool", "toy"]},
                        "note": {"type": ["string", "null"]},
                    },
                    "required": ["sku", "qty", "kind"],
                    "additionalProperties": False,
                },
            },
            "customer": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "address": {
                        "type": "object",
                        "properties": {
                            "street": {"type": "string"},
                            "city": {"type": "string"},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city"],
                    },
                },
                "required": ["id"],
            },
        },
        "required": ["items", "customer"],
        "additionalProperties": False,
    },
]
# Longer than any max_tokens here: constrained requests generate as many tokens as the others.
ENGINE_SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 20,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
}
SIM_STEP_MS = 5.0  # bench/scale.py's simulated GPU step


def rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


# ---- 1. libraries -----------------------------------------------------------------------


P = ParamSpec("P")
R = TypeVar("R")
Grammar = TypeVar("Grammar")  # a library's compiled grammar
Matcher = TypeVar("Matcher")  # a library's per-request matcher


@dataclass
class Library(Generic[Grammar, Matcher]):
    """One grammar library behind the same four calls."""

    name: str
    setup: Callable[[], None]  # the tokenizer (timed once)
    compile: Callable[[dict[str, Any]], Grammar]  # schema -> compiled grammar (uncached)
    matchers: Callable[[Grammar, int], list[Matcher]]  # compiled, n -> n fresh matchers
    fill: Callable[[list[Matcher]], np.ndarray]  # matchers -> [n, words] int32 (step's masks)
    consume: Callable[[Matcher, int], object]
    reset: Callable[[Matcher], object]


def llguidance_library(model_dir: Path, vocab: int, eos: int) -> Library[str, LLMatcher]:
    from llguidance import LLExecutor, LLMatcher, LLTokenizer

    from shared.structured_outputs import JSON_OPTIONS

    executor = LLExecutor()
    state: dict[str, LLTokenizer] = {}
    words = (vocab + 31) // 32
    buf = np.full((256, words), -1, dtype=np.int32)

    def setup() -> None:
        state["tok"] = LLTokenizer(str(model_dir / "tokenizer.json"), n_vocab=vocab, eos_token=eos)

    def compile_(schema: dict[str, Any]) -> str:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        m = LLMatcher(state["tok"], grammar, log_level=0)  # compiles lazily: force it
        assert not m.is_error(), m.get_error()
        return grammar

    def fill(ms_: list[LLMatcher]) -> np.ndarray:
        out = buf[: len(ms_)]
        pairs = list(zip(ms_, range(len(ms_)), strict=True))
        executor.unsafe_compute_mask_ptr(pairs, out.ctypes.data, words * 4, len(ms_))
        return out

    return Library(
        "llguidance",
        setup,
        compile_,
        lambda g, n: [LLMatcher(state["tok"], g, log_level=0) for _ in range(n)],
        fill,
        lambda m, t: m.consume_token(t),
        lambda m: m.reset(),
    )


def xgrammar_library(model_dir: Path, vocab: int, eos: int) -> Library[Any, Any] | None:
    try:
        import xgrammar as xgr  # type: ignore[import-not-found]  # optional, untyped
    except ImportError:
        return None
    from transformers import AutoTokenizer

    state: dict[str, Any] = {}

    def setup() -> None:
        hf = AutoTokenizer.from_pretrained(model_dir)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        state["compiler"] = xgr.GrammarCompiler(info, cache_enabled=False)
        state["bitmask"] = xgr.allocate_token_bitmask(256, vocab)
        state["batch"] = xgr.BatchGrammarMatcher()  # its own threads, as llguidance's executor

    def compile_(schema: dict[str, Any]) -> Any:
        return state["compiler"].compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
        )

    def fill(ms_: list[Any]) -> np.ndarray:
        bitmask = state["bitmask"]
        state["batch"].batch_fill_next_token_bitmask(ms_, bitmask)
        masks: np.ndarray = bitmask[: len(ms_)].numpy()
        return masks

    return Library(
        "xgrammar",
        setup,
        compile_,
        lambda g, n: [xgr.GrammarMatcher(g) for _ in range(n)],
        fill,
        lambda m, t: m.accept_token(t),
        lambda m: m.reset(),
    )


def allowed_tokens(row: np.ndarray, vocab: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])


def walk(
    lib: Library[Grammar, Matcher], grammar: Grammar, n: int, steps: int, vocab: int, eos: int
) -> list[float]:
    """Seconds per step to fill the masks of `n` matchers that each take a random allowed
    token per step (restarting when done)."""
    rng = np.random.default_rng(0)
    matchers = lib.matchers(grammar, n)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        masks = lib.fill(matchers)
        times.append(time.perf_counter() - t0)
        for m, row in zip(matchers, masks, strict=True):
            ids = allowed_tokens(row, vocab)
            token = int(rng.choice(ids))
            if token == eos or len(ids) == 0:
                lib.reset(m)
            else:
                lib.consume(m, token)
    return times


def bench_library(
    lib: Library[Grammar, Matcher], vocab: int, eos: int, batches: list[int], steps: int
) -> dict[str, Any]:
    gc.collect()
    rss0 = rss_mib()
    t0 = time.perf_counter()
    lib.setup()
    setup_s = time.perf_counter() - t0
    compile_s, grammars = [], []
    for schema in SCHEMAS:
        t0 = time.perf_counter()
        grammars.append(lib.compile(schema))
        compile_s.append(time.perf_counter() - t0)
    masks = {}
    for n in batches:
        times = walk(lib, grammars[-1], n, steps, vocab, eos)
        masks[n] = statistics.median(times[2:])
    held = lib.matchers(grammars[-1], 256)
    for m in held:
        lib.fill([m])
    mem = rss_mib() - rss0
    del held
    return {"setup": setup_s, "compile": compile_s, "mask": masks, "mem": mem}


def library_table(results: dict[str, dict[str, Any]], batches: list[int]) -> str:
    head = ["library", "tokenizer set-up ms"]
    head += [f"compile schema {i + 1} ms" for i in range(len(SCHEMAS))]
    head += [f"mask ms/step, batch {n}" for n in batches]
    head += ["µs/token at the largest batch", "RSS MiB (set-up + 256 matchers)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        per_tok = r["mask"][batches[-1]] / batches[-1] * 1e6
        cells = [name, ms(r["setup"]), *(ms(c) for c in r["compile"])]
        cells += [ms(r["mask"][n]) for n in batches] + [f"{per_tok:.1f}", f"{r['mem']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- 2. engine ---------------------------------------------------------------------------


class StepClock:
    """Wraps a runner's step, its mask fill and the sampler's mask apply with timers."""

    def __init__(self, runner: ModelRunner) -> None:
        from services.worker.sampler import processors

        self.step: list[float] = []
        self.fill: list[float] = []
        self.apply: list[float] = []
        self.batch: list[int] = []
        execute, grammar_mask = runner.execute, runner._grammar_mask
        apply = processors.apply_grammar_mask

        def timed(lst: list[float], fn: Callable[P, R]) -> Callable[P, R]:
            def wrapper(*args: P.args, **kw: P.kwargs) -> R:
                t0 = time.perf_counter()
                out = fn(*args, **kw)
                lst.append(time.perf_counter() - t0)
                return out

            return wrapper

        def step(plan: BatchPlan) -> ModelRunnerOutput | None:
            self.batch.append(len(plan.num_scheduled_tokens))
            return timed(self.step, execute)(plan)

        # for the rest of the run: the timers wrap the runner's and the sampler's own calls
        for target, name, wrapper in (
            (runner, "execute", step),
            (runner, "_grammar_mask", timed(self.fill, grammar_mask)),
            (processors, "apply_grammar_mask", timed(self.apply, apply)),
        ):
            setattr(target, name, wrapper)

    def reset(self) -> None:
        for lst in (self.step, self.fill, self.apply, self.batch):
            lst.clear()


def bench_engine(batches: list[int], max_tokens: int) -> str:
    from services.offline import LLM, SamplingParams
    from shared.structured_outputs import StructuredOutputsParams

    llm = LLM(max_num_seqs=max(batches), max_num_batched_tokens=8192, kv_cache_gib=1.0)
    clock = StepClock(llm.runner)
    structure = StructuredOutputsParams(json=json.dumps(ENGINE_SCHEMA))
    prompt = "List twenty people with their ages as JSON."
    head = (
        "| batch | mode | wall s | tokens/s | decode step ms (median) | mask fill ms | apply ms |"
    )
    lines = [head, "|---|---|---|---|---|---|---|"]
    share = {}
    for n in batches:
        for mode in ("unconstrained", "json schema"):
            params = SamplingParams(
                temperature=0.8,
                seed=1,
                max_tokens=max_tokens,
                ignore_eos=mode == "unconstrained",
                structured_outputs=structure if mode == "json schema" else None,
            )
            llm.generate([prompt], params)  # warm-up
            clock.reset()
            t0 = time.perf_counter()
            outs = llm.generate([prompt] * n, params)
            wall = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            decode = [s for s, b in zip(clock.step, clock.batch, strict=True) if b == n][1:]
            step = statistics.median(decode) if decode else float("nan")
            fill = statistics.median(clock.fill[1:]) if len(clock.fill) > 1 else 0.0
            apply = statistics.median(clock.apply[1:]) if len(clock.apply) > 1 else 0.0
            lines.append(
                f"| {n} | {mode} | {wall:.2f} | {tokens / wall:.0f} | {ms(step)} | "
                f"{ms(fill) if fill else '-'} | {ms(apply) if apply else '-'} |"
            )
            if mode == "json schema":
                share[n] = (step, fill, apply)
    notes = []
    for n, (step, fill, apply) in share.items():
        notes.append(
            f"- batch {n}: mask fill {ms(fill)} ms + apply {ms(apply)} ms = "
            f"{(fill + apply) / step:.1%} of a {ms(step)} ms CPU decode step; the fill is "
            f"{fill * 1e3 / SIM_STEP_MS:.0%} of the {SIM_STEP_MS:g} ms simulated GPU step"
        )
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--mask-batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--mask-steps", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--skip-engine", action="store_true")
    args = p.parse_args()

    from services.worker.gguf_convert import ensure_default_model
    from services.worker.model_config import ModelConfig

    model_dir = Path(ensure_default_model(progress=False))
    mc = ModelConfig.from_dir(model_dir)
    vocab, eos = mc.vocab_size, mc.eos_token_ids[0]
    results = {}
    for make in (llguidance_library, xgrammar_library):
        lib = make(model_dir, vocab, eos)
        if lib is not None:
            results[lib.name] = bench_library(lib, vocab, eos, args.mask_batches, args.mask_steps)
    print(
        "## Grammar libraries (SmolLM2 tokenizer, 49152 tokens; schemas in bench/structured.py)\n"
    )
    print(library_table(results, args.mask_batches))
    if not args.skip_engine:
        print("\n## Offline engine, CPU (SmolLM2-135M, temperature 0.8)\n")
        print(bench_engine(args.batches, args.max_tokens))


if __name__ == "__main__":
    main()
