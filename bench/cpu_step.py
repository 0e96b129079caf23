"""CPU decode benchmark: the CPU worker's engines side by side in one process, on the same
prompts.

- `torch`: torch's own ops (the C++ ops off, `gemv_layout` weights, eager decode): the worker
  before its C++ ops;
- `fp32`: the default, the C++ ops (kernels/csrc) with fp32 weights: exact;
- `bf16`, `bf16_dot`, `int8`, `q8_0`: the same with `--cpu-weights bf16` / `bf16_dot` /
  `int8` / `q8_0` (services/worker/weight_format.py; bf16_dot rounds the activations to bf16
  too, q8_0 quantizes them).

    python bench/cpu_step.py [--requests 32] [--single-tokens 64] [--repeats 3] [--no-served]

Prints single-stream decode tok/s (a 32-token prompt, best of `--repeats`, the engines
interleaved), the reference workload's output tok/s through `LLM.generate`, and each engine's
greedy agreement with `fp32` on two sets: the reference workload (corpus prompts) and eight
chat questions through the chat template (128 tokens each, stopping at EOS). Agreement is
counted as the tokens each request produces before its first difference, over all tokens.
Unless `--no-served`, the workload also goes through a real stack (HTTP, NATS, a CPU worker
with the C++ ops) and is compared with in-process `fp32`. The prompt sets (`prompt_sets`),
`agreement` and `decode_only` (a request's decode steps alone, as llama-bench's tg64 counts
them) also serve `make bench` (bench/bench.py) and bench/precision.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import roofline  # noqa: E402
from bench.workload import QUESTIONS, TokenEncoder, reference_workload, token_prompts  # noqa: E402
from kernels import cpu_ops  # noqa: E402
from services.offline import LLM, SamplingParams  # noqa: E402
from services.worker.loader import gemv_layout  # noqa: E402
from services.worker.weight_format import unpack_weights  # noqa: E402

ENGINES = ("torch", "fp32", "bf16", "bf16_dot", "int8", "q8_0")


def greedy(n: int, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos)


def build(name: str, max_num_seqs: int) -> LLM:
    # no prefix caching: the repeats and the served path must not reuse earlier runs' KV
    if name == "torch":
        llm = LLM(fused_cpu_decode=False, max_num_seqs=max_num_seqs, enable_prefix_caching=False)
        unpack_weights(llm.runner.model)  # torch's ops read row-major weights
        gemv_layout(llm.runner.model)
        return llm
    return LLM(max_num_seqs=max_num_seqs, cpu_weights=name, enable_prefix_caching=False)


def timed(
    name: str, llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[float, list[list[int]]]:
    """(output tok/s, the token ids of each request); `torch` runs with the C++ ops off."""
    cpu_ops.use(name != "torch")
    try:
        start = time.perf_counter()
        results = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    finally:
        cpu_ops.use(True)
    tokens = [r.outputs[0].token_ids for r in results]
    return sum(map(len, tokens)) / elapsed, tokens


def engine_run(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> tuple[float, int]:
    """(seconds, output tokens) of greedy requests of exactly `outputs` tokens each."""
    params = [greedy(n) for n in outputs]
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(r.outputs[0].token_ids) for r in results)


def decode_only(llm: LLM, prompt: list[int], new_tokens: int = 64, repeats: int = 3) -> float:
    """Decode steps alone, as llama-bench's tg<new_tokens> counts them: tokens/s of a request
    producing new_tokens + 1 tokens, less the time of the same request producing 1 (its
    prefill and first token); best of `repeats`."""

    def best(n: int) -> float:
        return min(engine_run(llm, [prompt], [n])[0] for _ in range(repeats))

    return new_tokens / (best(new_tokens + 1) - best(1))


def tg_prompt(tokenizer: TokenEncoder) -> list[int]:
    """The 16-token prompt `decode_only` decodes after in `make bench` and bench/precision.py."""
    return token_prompts(tokenizer, [16], seed=3)[0]


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[int, int]:
    """(tokens before each request's first difference from `reference`, all of reference's
    tokens); a request that ends before its reference differs where it ends."""
    same = 0
    for got, want in zip(tokens, reference, strict=True):
        pairs = enumerate(zip(got, want, strict=False))
        same += next((i for i, (a, b) in pairs if a != b), min(len(got), len(want)))
    return same, sum(map(len, reference))


def share(counts: tuple[int, int]) -> str:
    """An `agreement` as "same/total (percent)"."""
    same, total = counts
    return f"{same}/{total} ({100 * same / total:.1f}%)"


def chat_prompts(llm: LLM) -> list[list[int]]:
    tokenizer = llm.tokenizer
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


@dataclass(frozen=True)
class PromptSet:
    """Greedy requests whose tokens are compared between engines: token-id prompts, each
    with its token budget, all stopping at EOS or all not."""

    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    ignore_eos: bool

    def params(self) -> list[SamplingParams]:
        return [greedy(n, self.ignore_eos) for n in self.max_tokens]


def prompt_sets(llm: LLM, requests: int) -> tuple[PromptSet, PromptSet]:
    """The agreement sets: the reference workload (`requests` corpus prompts, `ignore_eos`)
    and the chat questions through the chat template (128 tokens each, stopping at EOS)."""
    prompts, outputs = reference_workload(llm.tokenizer, requests)
    chats = chat_prompts(llm)
    return (
        PromptSet("workload", prompts, outputs, ignore_eos=True),
        PromptSet("chat", chats, [128] * len(chats), ignore_eos=False),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--single-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--no-served",
        dest="served",
        action="store_false",
        help="skip the workload through a real stack (HTTP, NATS, a CPU worker)",
    )
    args = p.parse_args()
    if not cpu_ops.load():
        sys.exit("the C++ CPU ops do not build or run here (see the log above)")
    print(roofline.cpu_line())
    engines: dict[str, LLM] = {}
    for name in ENGINES:
        start = time.perf_counter()
        engines[name] = build(name, max(args.requests, len(QUESTIONS)))
        print(f"{name}: engine built in {time.perf_counter() - start:.1f} s", flush=True)
    single = token_prompts(engines["fp32"].tokenizer, [32])
    workload, chats = prompt_sets(engines["fp32"], args.requests)
    prompts, outputs = workload.prompts, workload.max_tokens
    for name, llm in engines.items():  # warm-up
        timed(name, llm, prompts[:2], [greedy(4), greedy(4)])
    best = dict.fromkeys(engines, 0.0)
    for _ in range(args.repeats):
        for name, llm in engines.items():
            rate = timed(name, llm, single, [greedy(args.single_tokens)])[0]
            best[name] = max(best[name], rate)
    rates, tokens, chat_tokens = {}, {}, {}
    for name, llm in engines.items():
        rates[name], tokens[name] = timed(name, llm, prompts, workload.params())
        chat_tokens[name] = timed(name, llm, chats.prompts, chats.params())[1]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in engines:
        print(
            f"{name:>5}: single stream {best[name]:6.1f} tok/s "
            f"({best[name] / best['torch']:.2f}x of torch), workload ({args.requests} requests) "
            f"{rates[name]:6.1f} tok/s ({rates[name] / rates['torch']:.2f}x), greedy agreement "
            f"with fp32: workload {share(agreement(tokens[name], tokens['fp32']))}, "
            f"chat {share(agreement(chat_tokens[name], chat_tokens['fp32']))}"
        )
    if args.served:
        from bench.served import run_served

        model_dir = engines["fp32"].runner.config.model_dir
        served = run_served(model_dir, prompts, outputs)[0]["tokens_per_s"]
        print(
            f"served (all at once, fp32 worker): {served:6.1f} tok/s, "
            f"{served / rates['fp32']:.2f}x of in-process fp32"
        )


if __name__ == "__main__":
    main()
