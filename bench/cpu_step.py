"""CPU decode benchmark: the CPU worker's engines side by side in one process, on the same
prompts.

- `torch`: torch's own ops (the C++ ops off, `gemv_layout` weights, eager decode): the worker
  before its C++ ops;
- `fp32`: the default, the C++ ops (kernels/csrc) with fp32 weights: exact;
- `bf16`, `int8`, `q8_0`: the same with `--cpu-weights bf16` / `int8` / `q8_0`
  (services/worker/weight_format.py; q8_0 quantizes the activations too).

    python bench/cpu_step.py [--requests 32] [--single-tokens 64] [--repeats 3] [--no-served]

Prints single-stream decode tok/s (a 32-token prompt, best of `--repeats`, the engines
interleaved), the reference workload's output tok/s through `LLM.generate`, and each engine's
greedy agreement with `fp32` on two sets: the reference workload (corpus prompts) and eight
chat questions through the chat template (128 tokens each, stopping at EOS). Agreement is
counted as the tokens each request produces before its first difference, over all tokens.
Unless `--no-served`, the workload also goes through a real stack (HTTP, NATS, a CPU worker
with the C++ ops) and is compared with in-process `fp32`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import roofline  # noqa: E402
from bench.workload import QUESTIONS, reference_workload, token_prompts  # noqa: E402
from kernels import cpu_ops  # noqa: E402
from services.offline import LLM, SamplingParams  # noqa: E402
from services.worker.loader import gemv_layout  # noqa: E402
from services.worker.weight_format import unpack_weights  # noqa: E402

ENGINES = ("torch", "fp32", "bf16", "int8", "q8_0")


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


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> str:
    """Tokens before each request's first difference from `reference`, over all tokens."""
    same = 0
    for got, want in zip(tokens, reference, strict=True):
        pairs = enumerate(zip(got, want, strict=False))
        same += next((i for i, (a, b) in pairs if a != b), len(want))
    return f"{same}/{sum(map(len, reference))}"


def chat_prompts(llm: LLM) -> list[list[int]]:
    tokenizer = llm.tokenizer
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


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
    tokenizer = engines["fp32"].tokenizer
    single = token_prompts(tokenizer, [32])
    prompts, outputs = reference_workload(tokenizer, args.requests)
    chats = chat_prompts(engines["fp32"])
    for name, llm in engines.items():  # warm-up
        timed(name, llm, prompts[:2], [greedy(4), greedy(4)])
    best = dict.fromkeys(engines, 0.0)
    for _ in range(args.repeats):
        for name, llm in engines.items():
            rate = timed(name, llm, single, [greedy(args.single_tokens)])[0]
            best[name] = max(best[name], rate)
    rates, tokens, chat_tokens = {}, {}, {}
    for name, llm in engines.items():
        rates[name], tokens[name] = timed(name, llm, prompts, [greedy(n) for n in outputs])
        chat_params = [greedy(128, ignore_eos=False)] * len(chats)
        chat_tokens[name] = timed(name, llm, chats, chat_params)[1]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in engines:
        print(
            f"{name:>5}: single stream {best[name]:6.1f} tok/s "
            f"({best[name] / best['torch']:.2f}x of torch), workload ({args.requests} requests) "
            f"{rates[name]:6.1f} tok/s ({rates[name] / rates['torch']:.2f}x), greedy agreement "
            f"with fp32: workload {agreement(tokens[name], tokens['fp32'])}, "
            f"chat {agreement(chat_tokens[name], chat_tokens['fp32'])}"
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
