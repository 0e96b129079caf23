"""Sampler cost per step: the batched sampler against a naive per-request loop, and against a
SmolLM2 decode step, measured side by side in one run.

Per step means building the step's SamplingMetadata from the persistent batch plus the sampler
call, on logits of one SmolLM2 decode step (real, peaked distributions, vocab 49,152), tiled to
batch 1, 32 and 256. "off" is greedy with nothing else; "on" turns every feature on in every
row: allowed_token_ids (a 45k-token whitelist), bad words, min_tokens, logit_bias, the three
penalties over a 128-token history, temperature, min_p, top-k, top-p, a seed and 5 logprobs.
The naive loop does the same per request with plain torch ops and full-vocabulary sorts.
With every feature on at batch 256, each sampler stage (STAGES) is also timed on its own.

python bench/sampler_bench.py   (bench/bench.py calls run_sampler_bench())
python bench/sampler_bench.py --cpu-time   CPU time of the all-on batch-256 step on one thread
    (time.process_time; steadier than wall time on a shared machine)
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import TypedDict
from unittest.mock import patch

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.workload import token_prompts  # noqa: E402
from services.offline import LLM, SamplingParams  # noqa: E402
from services.worker.input_batch import CachedRequestState, InputBatch  # noqa: E402
from services.worker.model_runner import StepInputs  # noqa: E402
from services.worker.sampler import Sampler, topk_topp  # noqa: E402
from services.worker.sampler import sampler as sampler_module  # noqa: E402
from services.worker.sampler.random import position_uniforms  # noqa: E402
from services.worker.sampling_metadata import build_sampling_metadata  # noqa: E402

BATCHES = (1, 32, 256)
DECODE_BATCH = 256
HISTORY = 64  # prompt and output tokens per request
NEG_INF = float("-inf")


class SamplerRow(TypedDict):
    batch: int
    features: str  # "off" (greedy) or "on" (every sampling feature)
    batched_ms: float
    naive_ms: float
    speedup: float


class DecodeShare(TypedDict):
    """The sampler with every feature on at DECODE_BATCH against a decode step."""

    decode_step_ms: float
    forward_ms: float
    lm_head_ms: float
    all_on_256_fraction: float
    under_10_percent: bool
    stages_ms: dict[str, float]  # median ms of each sampler stage with every feature on


# Sampler stages timed one by one (all features on, DECODE_BATCH rows): (owner, attribute).
STAGES: dict[str, tuple[object, str]] = {
    "metadata": (sys.modules[__name__], "build_sampling_metadata"),
    "fp32 copy + whitelist": (Sampler, "_working_logits"),
    "bad words, min_tokens, bias": (sampler_module, "apply_logit_processors"),
    "penalties": (sampler_module, "apply_penalties"),
    "min-p, top-k, top-p cutoffs": (topk_topp, "compute_cutoffs"),
    "draw": (sampler_module, "draw"),
    "logprobs": (sampler_module, "_attach_logprobs"),
}


def params_for(features: str, i: int, vocab: int) -> SamplingParams:
    if features == "off":
        return SamplingParams(temperature=0.0)
    return SamplingParams(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.05,
        seed=i,
        repetition_penalty=1.1,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        logit_bias={7: 2.0, 11: -3.0, 13: 1.0},
        min_tokens=1000,  # still below: EOS and stop ids are banned this step
        stop_token_ids=[5, 6],
        bad_words_token_ids=[[100], [200, 201], [300, 301, 302]],
        allowed_token_ids=list(range(vocab - 4096)),
        logprobs=5,
    )


class Case:
    """One batch of requests in a persistent batch, with its step's logits."""

    def __init__(self, features: str, logits: torch.Tensor) -> None:
        n, vocab = logits.shape
        gen = torch.Generator().manual_seed(n)
        self.vocab, self.logits = vocab, logits
        self.batch = InputBatch(n, 2 * HISTORY + 1, 16)
        self.reqs = []
        for i in range(n):
            tokens = torch.randint(0, vocab, (2 * HISTORY,), generator=gen).tolist()
            params = params_for(features, i, vocab)
            state = CachedRequestState(f"r{i}", tokens[:HISTORY], params, [], 0, tokens[HISTORY:])
            self.batch.add_request(state)
            self.reqs.append(state)
        self.rows = np.arange(n)


def batched_step(
    case: Case, sampler: Sampler, logits: torch.Tensor, eos: tuple[int, ...]
) -> torch.Tensor:
    meta = build_sampling_metadata(case.batch, case.rows, case.vocab, eos, logits.device)
    return sampler(logits, meta).sampled_token_ids


def naive_step(
    case: Case, sampler: Sampler, logits: torch.Tensor, eos: tuple[int, ...]
) -> torch.Tensor:
    """What one writes first: a loop over requests, plain torch per row, full sorts."""
    return torch.tensor([naive_one(logits[i], state, eos) for i, state in enumerate(case.reqs)])


def naive_one(x: torch.Tensor, state: CachedRequestState, eos: tuple[int, ...]) -> int:
    p, out = state.sampling_params, state.output_token_ids
    x = x.float().clone()
    raw = x.log_softmax(-1) if p.logprobs is not None else None
    if p.allowed_token_ids is not None:
        banned = torch.ones_like(x, dtype=torch.bool)
        banned[p.allowed_token_ids] = False
        x[banned] = NEG_INF
    for word in p.bad_words_token_ids or []:
        if len(word) - 1 <= len(out) and out[len(out) - len(word) + 1 :] == word[:-1]:
            x[word[-1]] = NEG_INF
    if len(out) < p.min_tokens:
        x[[*p.stop_token_ids, *eos]] = NEG_INF
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    x = naive_penalties(x, state)
    token = naive_sample(x, p, len(out))
    if raw is not None and p.logprobs is not None:
        raw.topk(p.logprobs)
        int((raw >= raw[token]).sum())
    return token


def naive_penalties(x: torch.Tensor, state: CachedRequestState) -> torch.Tensor:
    p = state.sampling_params
    output = torch.tensor(state.output_token_ids, dtype=torch.long)
    seen = torch.zeros_like(x, dtype=torch.bool)
    seen[torch.tensor(state.prompt_token_ids)] = True
    seen[output] = True
    r = p.repetition_penalty
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    counts = torch.bincount(output, minlength=len(x)).float()
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def naive_sample(x: torch.Tensor, p: SamplingParams, position: int) -> int:
    if p.greedy:
        return int(x.argmax())
    x = x / p.temperature
    probs = x.softmax(-1)
    x[probs < p.min_p * probs.max()] = NEG_INF
    values, order = x.sort(descending=True)
    values[p.top_k :] = NEG_INF
    probs = values.softmax(-1)
    values[(probs.cumsum(-1) - probs) >= p.top_p] = NEG_INF
    gen = torch.Generator().manual_seed(
        int(position_uniforms(torch.tensor([p.seed or 0]), torch.tensor([position])) * 2**24)
    )
    return int(order[torch.multinomial(values.softmax(-1), 1, generator=gen)])


def median_ms(fn: Callable[[torch.Tensor], object], logits: torch.Tensor, reps: int) -> float:
    fn(logits.clone())  # warm-up
    times = []
    for _ in range(reps):
        x = logits.clone()
        start = time.perf_counter()
        fn(x)
        _sync(x)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _sync(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize()


def stage_times(
    case: Case, logits: torch.Tensor, eos: tuple[int, ...], reps: int
) -> dict[str, float]:
    """Median ms of each of STAGES over `reps` sampler steps (after a warm-up step)."""
    times: dict[str, list[float]] = {name: [] for name in STAGES}

    def timed(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def run(*args: object, **kwargs: object) -> object:
            _sync(logits)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            _sync(logits)
            times[name].append(time.perf_counter() - start)
            return out

        return run

    sampler = Sampler(seed=0)
    with ExitStack() as stack:
        for name, (owner, attr) in STAGES.items():
            stack.enter_context(patch.object(owner, attr, timed(name, getattr(owner, attr))))
        for _ in range(reps + 1):
            batched_step(case, sampler, logits.clone(), eos)
    return {name: 1e3 * statistics.median(t[1:]) for name, t in times.items() if len(t) > 1}


def decode_step(llm: LLM, batch: int) -> tuple[float, float, torch.Tensor]:
    """Median ms of the model forward of `batch` decode tokens and of its LM head (logits),
    and one step's logits [batch, vocab]."""
    runner, forward, times, hidden = llm.runner, llm.runner._forward, [], []

    def timed(inputs: StepInputs) -> torch.Tensor:
        start = time.perf_counter()
        out = forward(inputs)
        if len(inputs.req_ids) == batch and len(inputs.positions) == batch:
            _sync(out)
            times.append(time.perf_counter() - start)
            hidden.append(out)
        return out

    with patch.object(runner, "_forward", timed):
        prompts = token_prompts(llm.tokenizer, [8] * batch, seed=1)
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    head = []
    with torch.inference_mode():
        for h in hidden:
            start = time.perf_counter()
            logits = runner.model.compute_logits(h).float()
            _sync(logits)
            head.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times), 1e3 * statistics.median(head), logits


def run_sampler_bench(device: str = "cpu") -> tuple[list[SamplerRow], DecodeShare]:
    """A row per batch size and feature set, and all features on at batch 256 against a
    SmolLM2 decode step (model forward + LM head)."""
    llm = LLM(max_num_batched_tokens=8 * DECODE_BATCH, max_num_seqs=DECODE_BATCH, device=device)
    forward_ms, head_ms, step_logits = decode_step(llm, DECODE_BATCH)
    mc = llm.runner.model_config
    eos = mc.eos_token_ids
    sampler, rows = Sampler(seed=0), list[SamplerRow]()
    for n in BATCHES:
        logits = step_logits[torch.arange(n) % len(step_logits)].contiguous()
        for features in ("off", "on"):
            case = Case(features, logits)
            reps = 7 if n < 256 else 5
            batched = median_ms(partial(batched_step, case, sampler, eos=eos), logits, reps)
            naive = median_ms(partial(naive_step, case, sampler, eos=eos), logits, 1)
            rows.append(
                SamplerRow(
                    batch=n,
                    features=features,
                    batched_ms=batched,
                    naive_ms=naive,
                    speedup=naive / batched,
                )
            )
    all_on = next(r for r in rows if r["batch"] == DECODE_BATCH and r["features"] == "on")
    stages = stage_times(Case("on", step_logits), step_logits, eos, reps=5)
    decode_ms = forward_ms + head_ms
    share = DecodeShare(
        decode_step_ms=decode_ms,
        forward_ms=forward_ms,
        lm_head_ms=head_ms,
        all_on_256_fraction=all_on["batched_ms"] / decode_ms,
        under_10_percent=all_on["batched_ms"] < 0.1 * decode_ms,
        stages_ms=stages,
    )
    return rows, share


def cpu_time_ms(steps: int = 15, rounds: int = 3) -> list[float]:
    """Median CPU ms of the all-on DECODE_BATCH step (metadata + call) on one thread, over
    `steps` steps, for each of `rounds` rounds, on one decode step's logits."""
    llm = LLM(max_num_batched_tokens=8 * DECODE_BATCH, max_num_seqs=DECODE_BATCH, device="cpu")
    logits = decode_step(llm, DECODE_BATCH)[2]
    case, eos = Case("on", logits), llm.runner.model_config.eos_token_ids
    sampler, threads = Sampler(seed=0), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batched_step(case, sampler, logits.clone(), eos)  # warm-up
        medians = []
        for _ in range(rounds):
            times = []
            for _ in range(steps):
                x = logits.clone()
                start = time.process_time()
                batched_step(case, sampler, x, eos)
                times.append(time.process_time() - start)
            medians.append(1e3 * statistics.median(times))
        return medians
    finally:
        torch.set_num_threads(threads)


def report(rows: list[SamplerRow], last: DecodeShare) -> None:
    print(f"{'batch':>5} {'features':>8} {'batched ms':>11} {'naive loop ms':>14} {'speedup':>8}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['features']:>8} {r['batched_ms']:>11.2f} "
            f"{r['naive_ms']:>14.2f} {r['speedup']:>7.1f}x"
        )
    print(
        f"SmolLM2 decode step at batch {DECODE_BATCH}: {last['decode_step_ms']:.1f} ms "
        f"(model forward {last['forward_ms']:.1f} + LM head {last['lm_head_ms']:.1f})"
    )
    verdict = "yes" if last["under_10_percent"] else "no"
    print(
        f"all features on at batch {DECODE_BATCH} costs "
        f"{100 * last['all_on_256_fraction']:.1f}% of a decode step; "
        f"< 10% of a decode step: {verdict}"
    )
    print(f"its stages (median ms, each timed alone, same {DECODE_BATCH} rows):")
    for name, ms in last["stages_ms"].items():
        print(f"  {name:<28} {ms:7.2f}")


if __name__ == "__main__":
    torch.manual_seed(0)
    if "--cpu-time" in sys.argv:
        medians = ", ".join(f"{ms:.1f}" for ms in cpu_time_ms())
        print(f"all features on at batch {DECODE_BATCH}, one thread: {medians} ms CPU per step")
    else:
        report(*run_sampler_bench("cuda" if "--cuda" in sys.argv else "cpu"))
