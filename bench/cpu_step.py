"""CPU decode-step benchmark, three engines in one process on the same prompts: `before`
(eager, row-major weights: the CPU worker before issue 14), `layout` (eager, GEMV-friendly
weights: services/worker/loader.py `gemv_layout`) and `compiled` (that plus the compiled
decode path, `--compile`).

    python bench/cpu_step.py [--requests 32] [--single-tokens 64] [--repeats 3]

Unless `--no-served`, the workload also goes through a real stack (a compiled CPU worker).
Prints single-stream decode tok/s (a 32-token prompt, best of `--repeats`, the engines
interleaved), the reference workload's output tok/s through `LLM.generate`, how long the
compiled path took to build, and the greedy agreement of each with `before`
(identical tokens / total).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.workload import reference_workload, token_prompts  # noqa: E402
from services.offline import LLM, SamplingParams  # noqa: E402


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def row_major(llm: LLM) -> None:
    """Undo `gemv_layout`: every weight back to a contiguous [out, in] matrix."""
    for module in llm.runner.model.modules():
        if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
            module.weight = torch.nn.Parameter(module.weight.contiguous(), requires_grad=False)


def timed(llm: LLM, prompts, outputs) -> tuple[float, list[list[int]]]:
    """(output tok/s, the token ids of each request)."""
    start = time.perf_counter()
    results = llm.generate(prompts, [greedy(n) for n in outputs])
    elapsed = time.perf_counter() - start
    return sum(outputs) / elapsed, [r.outputs[0].token_ids for r in results]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--single-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--no-served",
        dest="served",
        action="store_false",
        help="skip the workload through a real stack (HTTP, NATS, a compiled CPU worker)",
    )
    args = p.parse_args()
    engines: dict[str, LLM] = {}
    for name, compile_ in (("before", False), ("layout", False), ("compiled", True)):
        start = time.perf_counter()
        engines[name] = LLM(compile=compile_, max_num_seqs=max(args.requests, 1))
        print(f"{name}: engine built in {time.perf_counter() - start:.1f} s", flush=True)
    row_major(engines["before"])
    tokenizer = engines["before"].tokenizer
    single = token_prompts(tokenizer, [32])
    prompts, outputs = reference_workload(tokenizer, args.requests)
    for llm in engines.values():  # warm-up
        timed(llm, prompts[:2], [4, 4])
    best = dict.fromkeys(engines, 0.0)
    for _ in range(args.repeats):
        for name, llm in engines.items():
            best[name] = max(best[name], timed(llm, single, [args.single_tokens])[0])
    rates, tokens = {}, {}
    for name, llm in engines.items():
        rates[name], tokens[name] = timed(llm, prompts, outputs)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in engines:
        same = sum(
            a == b
            for x, y in zip(tokens["before"], tokens[name], strict=True)
            for a, b in zip(x, y, strict=True)
        )
        print(
            f"{name:>9}: single stream {best[name]:6.1f} tok/s "
            f"({best[name] / best['before']:.2f}x), workload ({args.requests} requests) "
            f"{rates[name]:6.1f} tok/s ({rates[name] / rates['before']:.2f}x), "
            f"greedy agreement with before {same}/{sum(outputs)}"
        )
    if args.served:
        from bench.served import run_served

        model_dir = engines["compiled"].runner.config.model_dir
        served = run_served(model_dir, prompts, outputs)[0]["tokens_per_s"]
        print(
            f"served (all at once, compiled worker): {served:6.1f} tok/s, "
            f"{served / rates['compiled']:.2f}x of in-process compiled"
        )


if __name__ == "__main__":
    main()
