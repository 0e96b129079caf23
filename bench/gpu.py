"""GPU benchmark: kernel checks and bandwidth, then the reference workload end to end.

    python -m bench.gpu [--quick] [--skip-kernels] [--skip-e2e] [--dtypes float32,bfloat16]

1. Measures the device's copy bandwidth (a 2 GiB device-to-device copy: bytes read + written).
2. Checks every Triton kernel against its torch reference on random inputs (odd shapes, every
   dtype), times kernel and reference (median after warm-up with L2 flushed, via
   triton.testing.do_bench) and reports the kernel's achieved bandwidth against the measured
   copy bandwidth. Paged-attention decode at batch 64 x 2k context is held to >= 70% of it,
   beside a sweep of its tiling knobs and torch SDPA over the same keys laid out densely.
3. Runs the reference workload (SmolLM2-135M, greedy, 32 requests, prompts of 16-256
   tokens, outputs of 16-128, all at once) through `LLM.generate` and, on the same GPU,
   transformers `generate` with static batches: output tokens/s, TTFT and inter-token latency,
   and how far the greedy outputs agree.

Results go to bench/results/gpu-<time>.json and .md. Without a CUDA device it says so and exits
0; it exits 1 when a kernel disagrees with its reference.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack
from unittest.mock import patch

import torch

from shared.arith import cdiv

if TYPE_CHECKING:
    from services.offline import LLM
    from services.scheduler.scheduler import RequestOutput

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DEVICE = "cuda"
DECODE_BW_TARGET = 0.70
BLOCK_SIZE = 16
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
Out = torch.Tensor | tuple[torch.Tensor, ...]
Workload = tuple[list[list[int]], list[int]]  # prompts' token ids, output lengths
Report = dict[str, Any]  # what the JSON report holds


class Knobs(TypedDict, total=False):
    """The paged-attention kernel's tiling knobs (unset: its own choice)."""

    num_splits: int
    tile_n: int
    num_warps: int


@dataclass(frozen=True)
class Sizes:
    """Timed shapes (Llama-3-8B-like layers); --quick shrinks them for a fast smoke run."""

    tokens: int = 4096  # tokens per step for the elementwise kernels
    hidden: int = 4096
    intermediate: int = 14336
    decode_batch: int = 64
    context: int = 2048
    requests: int = 32  # end-to-end workload

    @staticmethod
    def quick() -> Sizes:
        return Sizes(
            tokens=64, hidden=256, intermediate=512, decode_batch=4, context=64, requests=4
        )


@dataclass
class KernelResult:
    name: str
    case: str
    dtype: str
    max_abs_err: float
    ok: bool
    ms: float = 0.0  # median kernel time (0: checked, not timed)
    ref_ms: float = 0.0  # median time of the torch reference (the peer)
    gbytes: float = 0.0  # bytes the kernel must move
    gb_per_s: float = 0.0
    frac_of_copy: float = 0.0  # achieved / measured copy bandwidth
    tflops: float = 0.0


# --- timing and checking -----------------------------------------------------------------------


def bench_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of fn after warm-up, L2 flushed between runs."""
    import triton.testing  # type: ignore[import-untyped]

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy, counting bytes read and written."""
    src = torch.empty(2**29, dtype=torch.float32, device=DEVICE).normal_()  # 2 GiB
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / bench_ms(lambda: dst.copy_(src)) / 1e6


def pairs(got: Out, want: Out) -> list[tuple[torch.Tensor, torch.Tensor]]:
    def as_tuple(x: Out) -> tuple[torch.Tensor, ...]:
        return x if isinstance(x, tuple) else (x,)

    return list(zip(as_tuple(got), as_tuple(want), strict=True))


def max_err(got: Out, want: Out) -> float:
    errs = [(g.float() - w.float()).abs().max().item() for g, w in pairs(got, want) if g.numel()]
    return max(errs, default=0.0)


def allclose(got: Out, want: Out, dtype: torch.dtype) -> bool:
    tol = TOL[dtype]
    return all(
        g.shape == w.shape and torch.allclose(g.float(), w.float(), atol=4 * tol, rtol=tol)
        for g, w in pairs(got, want)
    )


def measure(
    name: str,
    case: str,
    dtype: torch.dtype,
    run: Callable[[], Out],
    ref: Callable[[], Out],
    copy_gbps: float,
    nbytes: int = 0,
    flops: float = 0.0,
) -> KernelResult:
    """Check run() against ref(); time both when nbytes (the traffic to report) is given."""
    got, want = run(), ref()
    dname = str(dtype).removeprefix("torch.")
    result = KernelResult(name, case, dname, max_err(got, want), allclose(got, want, dtype))
    line = f"  {name:18s} {case:40s} {dname:9s} err={result.max_abs_err:.1e} "
    line += "ok" if result.ok else "MISMATCH"
    if nbytes:
        result.ms, result.ref_ms = bench_ms(run), bench_ms(ref)
        result.gbytes = nbytes / 1e9
        result.gb_per_s = nbytes / result.ms / 1e6
        result.frac_of_copy = result.gb_per_s / copy_gbps
        result.tflops = flops / result.ms / 1e9
        line += f"  {result.ms * 1e3:8.1f} us {result.gb_per_s:6.0f} GB/s "
        line += f"({result.frac_of_copy:4.0%} of copy)  torch {result.ref_ms * 1e3:8.1f} us"
    print(line, flush=True)
    return result


def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=torch.float32).to(dtype)


def nbytes_of(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


# --- elementwise kernels -----------------------------------------------------------------------


def elementwise_cases(sizes: Sizes, copy_gbps: float) -> list[KernelResult]:
    """Each kernel on the timed (bf16) shape and on odd shapes in every dtype."""
    results = []
    for dtype in DTYPES:
        shapes = [(37, 576, 1536), (5, 80, 1000)]
        timed = dtype == torch.bfloat16
        if timed:
            shapes.insert(0, (sizes.tokens, sizes.hidden, sizes.intermediate))
        for i, (tokens, hidden, inter) in enumerate(shapes):
            time_it = timed and i == 0
            results.append(silu_case(tokens, inter, dtype, copy_gbps, time_it))
            results.append(rms_norm_case(tokens, hidden, dtype, copy_gbps, time_it))
        heads = [(37, 9, 3, 64, 64), (11, 5, 1, 80, 48)]
        if timed:
            heads.insert(0, (sizes.tokens, 32, 8, 128, 128))
        for i, (tokens, num_heads, kv_heads, head_dim, rot_dim) in enumerate(heads):
            time_it = timed and i == 0
            rotary_dims = (tokens, num_heads, kv_heads, head_dim, rot_dim)
            results.append(rotary_case(*rotary_dims, dtype, copy_gbps, time_it))
            results.append(kv_write_case(tokens, kv_heads, head_dim, dtype, copy_gbps, time_it))
    return results


def silu_case(
    tokens: int, inter: int, dtype: torch.dtype, copy_gbps: float, timed: bool
) -> KernelResult:
    from kernels import activation, reference

    x = randn(tokens, 2 * inter, dtype=dtype)  # [tokens, 2 * inter]
    traffic = 3 * tokens * inter * nbytes_of(dtype) if timed else 0
    return measure(
        "silu_and_mul",
        f"T={tokens} I={inter}",
        dtype,
        lambda: activation.silu_and_mul(x),
        lambda: reference.silu_and_mul(x),
        copy_gbps,
        traffic,
    )


def rms_norm_case(
    tokens: int, hidden: int, dtype: torch.dtype, copy_gbps: float, timed: bool
) -> KernelResult:
    from kernels import reference, rms_norm

    x, residual = randn(tokens, hidden, dtype=dtype), randn(tokens, hidden, dtype=dtype)
    weight = randn(hidden, dtype=dtype)
    traffic = (4 * tokens + 1) * hidden * nbytes_of(dtype) if timed else 0
    return measure(
        "fused_add_rms_norm",
        f"T={tokens} H={hidden}",
        dtype,
        lambda: rms_norm.rms_norm(x, weight, 1e-6, residual),
        lambda: reference.rms_norm(x, weight, 1e-6, residual),
        copy_gbps,
        traffic,
    )


def rotary_case(
    tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    rot_dim: int,
    dtype: torch.dtype,
    copy_gbps: float,
    timed: bool,
) -> KernelResult:
    from kernels import reference, rotary

    q = randn(tokens, heads, head_dim, dtype=dtype)  # [tokens, heads, head_dim]
    k = randn(tokens, kv_heads, head_dim, dtype=dtype)  # [tokens, kv_heads, head_dim]
    angles = torch.rand(8192, rot_dim // 2, device=DEVICE) * 100
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)  # [max_position, rot_dim] fp32
    pos = torch.randint(0, 8192, (tokens,), device=DEVICE)
    qk_bytes = 2 * tokens * (heads + kv_heads) * head_dim * nbytes_of(dtype)
    traffic = qk_bytes + tokens * (8 + rot_dim * 4) if timed else 0
    return measure(
        "rotary_embedding",
        f"T={tokens} heads={heads}/{kv_heads} D={head_dim} rot={rot_dim}",
        dtype,
        lambda: rotary.rotary_embedding(pos, q, k, cache),
        lambda: reference.rotary_embedding(pos, q, k, cache),
        copy_gbps,
        traffic,
    )


def kv_write_case(
    tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, copy_gbps: float, timed: bool
) -> KernelResult:
    from kernels import kv_cache, reference

    num_blocks = tokens // BLOCK_SIZE + 8
    k = randn(tokens, kv_heads, head_dim, dtype=dtype)  # [tokens, kv_heads, head_dim]
    v = randn(tokens, kv_heads, head_dim, dtype=dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:tokens]
    slots[:: max(2, tokens // 5)] = -1  # some padding
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    expected = cache.clone()

    def run() -> torch.Tensor:
        kv_cache.write_kv_cache(k, v, cache, slots)
        return cache

    def ref() -> torch.Tensor:
        reference.write_kv_cache(k, v, expected, slots)
        return expected

    traffic = 4 * tokens * kv_heads * head_dim * nbytes_of(dtype) if timed else 0
    case = f"T={tokens} kv_heads={kv_heads} D={head_dim}"
    return measure("write_kv_cache", case, dtype, run, ref, copy_gbps, traffic)


# --- paged attention ---------------------------------------------------------------------------


@dataclass
class AttnBatch:
    # query, kv_cache, query_start_loc, seq_lens, block_table
    args: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    max_query_len: int
    max_seq_len: int
    kv_bytes: int  # keys + values read, queries read, outputs written
    flops: float


def attn_batch(
    q_lens: list[int],
    seq_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> AttnBatch:
    """Requests with q_lens new tokens ending seq_lens contexts, in shuffled cache blocks."""
    nblocks = [cdiv(s, BLOCK_SIZE) for s in seq_lens]
    ids = torch.randperm(sum(nblocks) + 1, device=DEVICE).int()
    table = torch.zeros(len(q_lens), max(nblocks) + 1, dtype=torch.int32, device=DEVICE)
    ends = itertools.accumulate(nblocks)
    for i, (n, end) in enumerate(zip(nblocks, ends, strict=True)):
        table[i, :n] = ids[end - n : end]
    qsl = [0, *itertools.accumulate(q_lens)]
    es = nbytes_of(dtype)
    lens = zip(q_lens, seq_lens, strict=True)
    causal_pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in lens)
    query = randn(sum(q_lens), heads, head_dim, dtype=dtype)  # [tokens, heads, head_dim]
    kv_cache = randn(2, sum(nblocks) + 1, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype)
    return AttnBatch(
        args=(
            query,
            kv_cache,
            torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            table,
        ),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        kv_bytes=2 * (sum(seq_lens) * kv_heads + sum(q_lens) * heads) * head_dim * es,
        flops=4.0 * causal_pairs * heads * head_dim,
    )


def attention_case(
    name: str,
    b: AttnBatch,
    dtype: torch.dtype,
    copy_gbps: float,
    timed: bool,
    **knobs: Unpack[Knobs],
) -> KernelResult:
    from kernels import paged_attention as pa
    from kernels import reference

    scale = b.args[0].shape[-1] ** -0.5
    return measure(
        "paged_attention",
        name,
        dtype,
        lambda: pa.paged_attention(
            *b.args, scale, max_query_len=b.max_query_len, max_seq_len=b.max_seq_len, **knobs
        ),
        lambda: reference.paged_attention(*b.args, scale),
        copy_gbps,
        b.kv_bytes if timed else 0,
        b.flops,
    )


def attention_cases(sizes: Sizes, copy_gbps: float) -> tuple[list[KernelResult], Report]:
    """Mixed, prefill-only and decode-only batches; head sizes 128, 64, 80; GQA groups 4, 3, 5."""
    results = []
    rng = random.Random(0)
    for dtype in DTYPES:
        for heads, kv_heads, head_dim in ((32, 8, 128), (9, 3, 64), (10, 2, 80)):
            dims = (heads, kv_heads, head_dim, dtype)
            shape = f"{heads}/{kv_heads}x{head_dim}"
            contexts = [rng.randint(1, 700) for _ in range(12)]
            # a chunk starting mid-block, a whole block, long and short decodes, an idle request
            q_lens, seq_lens = [77, 16, 1, 0, 300] + [1] * 12, [90, 16, 2000, 40, 333, *contexts]
            mixed = attn_batch(q_lens, seq_lens, *dims)
            prefill = attn_batch([5, 64, 129], [21, 64, 300], *dims)
            results += [
                attention_case(f"mixed {shape}", mixed, dtype, copy_gbps, False),
                attention_case(
                    f"mixed {shape} splits=3", mixed, dtype, copy_gbps, False, num_splits=3
                ),
                attention_case(f"prefill only {shape}", prefill, dtype, copy_gbps, False),
            ]
    batch, ctx = sizes.decode_batch, sizes.context
    decode = attn_batch([1] * batch, [ctx] * batch, 32, 8, 128, torch.bfloat16)
    name = f"decode B={batch} ctx={ctx} 32/8x128"
    results.append(attention_case(name, decode, torch.bfloat16, copy_gbps, True))
    sweep = decode_sweep(decode, copy_gbps)
    results.append(sdpa_peer(name, decode, copy_gbps))
    small = attn_batch([1] * batch, [ctx] * batch, 9, 3, 64, torch.bfloat16)
    name = f"decode B={batch} ctx={ctx} 9/3x64"
    results.append(attention_case(name, small, torch.bfloat16, copy_gbps, True))
    q_lens, seq_lens = [ctx] * 4 + [1] * (batch - 4), [ctx] * 4 + [ctx // 2] * (batch - 4)
    mixed = attn_batch(q_lens, seq_lens, 32, 8, 128, torch.bfloat16)
    name = f"mixed 4x{ctx} prefill + {batch - 4} decode"
    results.append(attention_case(name, mixed, torch.bfloat16, copy_gbps, True))
    return results, sweep


def decode_sweep(b: AttnBatch, copy_gbps: float) -> Report:
    """The decode kernel's default tiling against every combination of its knobs."""
    from kernels import paged_attention as pa

    scale = b.args[0].shape[-1] ** -0.5

    def run(**knobs: Unpack[Knobs]) -> torch.Tensor:
        return pa.paged_attention(
            *b.args, scale, max_query_len=1, max_seq_len=b.max_seq_len, **knobs
        )

    def frac(ms: float) -> float:
        return b.kv_bytes / ms / 1e6 / copy_gbps

    rows: list[Report] = []
    for splits, tile_n, warps in itertools.product((1, 2, 4, 8), (32, 64), (4, 8)):
        knobs = Knobs(num_splits=splits, tile_n=tile_n, num_warps=warps)
        ms = bench_ms(partial(run, **knobs))
        rows.append({**knobs, "us": ms * 1e3, "frac_of_copy": frac(ms)})
    default_ms = bench_ms(run)
    best = max(rows, key=lambda r: r["frac_of_copy"])
    print(
        f"  decode: default {frac(default_ms):.0%} of copy bandwidth "
        f"(target {DECODE_BW_TARGET:.0%}); best {best}",
        flush=True,
    )
    return {
        "default_us": default_ms * 1e3,
        "default_frac_of_copy": frac(default_ms),
        "best": best,
        "target": DECODE_BW_TARGET,
        "meets_target": frac(default_ms) >= DECODE_BW_TARGET,
        "rows": rows,
    }


def sdpa_peer(name: str, b: AttnBatch, copy_gbps: float) -> KernelResult:
    """torch SDPA over the same keys laid out densely: what a non-paged kernel achieves."""
    query, kv_cache, _, seq_lens, table = b.args
    num_reqs, num_blocks = seq_lens.shape[0], b.max_seq_len // BLOCK_SIZE
    kv = kv_cache[:, table[:, :num_blocks].long()]  # [2, reqs, blocks, block_size, kvh, d]
    k, v = (t.flatten(1, 2).transpose(1, 2).contiguous() for t in kv)  # [reqs, kvh, seq, d]
    q = query.view(num_reqs, -1, 1, query.shape[-1])  # [reqs, heads, 1, d]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ms = bench_ms(lambda: sdpa(q, k, v, enable_gqa=True))
    gbps = b.kv_bytes / ms / 1e6
    print(f"  {'sdpa (dense peer)':18s} {name:40s} {ms * 1e3:8.1f} us {gbps:6.0f} GB/s", flush=True)
    return KernelResult(
        "sdpa_dense_peer",
        name,
        "bfloat16",
        0.0,
        True,
        ms,
        0.0,
        b.kv_bytes / 1e9,
        gbps,
        gbps / copy_gbps,
    )


# --- end to end --------------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {}
    qs = statistics.quantiles(values, n=100, method="inclusive")
    return {"mean": statistics.fmean(values), "p50": qs[49], "p90": qs[89], "p99": qs[98]}


@contextmanager
def token_stamps(llm: LLM) -> Iterator[dict[str, list[float]]]:
    """Timestamps of each request's tokens as the engine yields them (for TTFT and ITL)."""
    stamps: dict[str, list[float]] = {}
    run = llm._run

    def timed_run() -> Iterator[RequestOutput]:
        for out in run():
            now = time.perf_counter()
            stamps.setdefault(out.req_id, []).extend([now] * len(out.new_token_ids))
            yield out

    with patch.object(llm, "_run", timed_run):
        yield stamps


def skiff_e2e(dtype: str, workload: Workload, warm: Workload) -> tuple[Report, list[list[int]]]:
    """LLM.generate on the workload, after a warm-up run that compiles the kernels."""
    from services.offline import LLM, SamplingParams

    def params(lens: list[int]) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]

    llm = LLM(model=None, device=DEVICE, dtype=dtype)
    llm.generate(warm[0], params(warm[1]))
    with token_stamps(llm) as stamps:
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(workload[0], params(workload[1]))
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    itl = [b - a for s in stamps.values() for a, b in itertools.pairwise(s) if b > a]
    return {
        "engine": "skiff LLM.generate",
        "dtype": dtype,
        "seconds": elapsed,
        "output_tokens": sum(map(len, tokens)),
        "output_tokens_per_s": sum(map(len, tokens)) / elapsed,
        "ttft_s": percentiles([s[0] - start for s in stamps.values() if s]),
        "itl_s": percentiles(itl),
    }, tokens


def hf_e2e(
    model_dir: Path, dtype: str, workload: Workload, batch_size: int, pad_id: int
) -> tuple[Report, list[list[int]]]:
    """transformers generate with static batches: each batch runs to its longest output."""
    from transformers import AutoModelForCausalLM

    prompts, out_lens = workload
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    # transformers types its `to` through functools.wraps, which leaves `self` unbound
    model = model.to(DEVICE).eval()  # type: ignore[arg-type]

    def run_batch(batch: list[list[int]], max_new: int) -> list[list[int]]:
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=DEVICE)
        mask = (
            torch.arange(width, device=DEVICE)
            >= width - torch.tensor([len(p) for p in batch], device=DEVICE)[:, None]
        ).long()
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad_id,
        )
        new_tokens: list[list[int]] = out[:, width:].tolist()
        return new_tokens

    with torch.inference_mode():
        run_batch(prompts[:batch_size], 4)  # warm-up
        torch.cuda.synchronize()
        start, tokens = time.perf_counter(), []
        for i in range(0, len(prompts), batch_size):
            lens = out_lens[i : i + batch_size]
            new = run_batch(prompts[i : i + batch_size], max(lens))
            tokens += [row[:n] for row, n in zip(new, lens, strict=True)]
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {
        "engine": f"transformers generate, static batch {batch_size}",
        "dtype": dtype,
        "seconds": elapsed,
        "output_tokens": sum(out_lens),
        "output_tokens_per_s": sum(out_lens) / elapsed,
    }, tokens


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """How far two engines' greedy outputs agree: exact matches, mean common-prefix share."""
    prefix = []
    for x, y in zip(a, b, strict=True):
        diffs = (i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q)
        prefix.append(next(diffs, min(len(x), len(y))) / max(1, len(x)))
    exact = sum(x == y for x, y in zip(a, b, strict=True)) / max(1, len(a))
    return {"exact": exact, "mean_common_prefix": statistics.fmean(prefix) if prefix else 0.0}


def e2e(sizes: Sizes, dtypes: list[str], hf_batch_sizes: list[int]) -> list[Report]:
    from transformers import AutoTokenizer

    from bench.workload import reference_workload
    from services.worker.gguf_convert import ensure_default_model

    model_dir = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workload = reference_workload(tokenizer, sizes.requests, seed=0)
    warm = reference_workload(tokenizer, sizes.requests, seed=1)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = []
    for dtype in dtypes:
        skiff, skiff_tokens = skiff_e2e(dtype, workload, warm)
        torch.cuda.empty_cache()
        rows.append(skiff)
        print(f"  skiff {dtype}: {skiff['output_tokens_per_s']:.0f} output tok/s", flush=True)
        for batch_size in hf_batch_sizes:
            hf, hf_tokens = hf_e2e(model_dir, dtype, workload, batch_size, pad_id)
            torch.cuda.empty_cache()
            hf["skiff_speedup"] = skiff["output_tokens_per_s"] / hf["output_tokens_per_s"]
            hf["greedy_agreement_with_skiff"] = agreement(skiff_tokens, hf_tokens)
            rows.append(hf)
            print(
                f"  {hf['engine']} {dtype}: {hf['output_tokens_per_s']:.0f} output tok/s, "
                f"skiff x{hf['skiff_speedup']:.2f}",
                flush=True,
            )
    return rows


# --- report ------------------------------------------------------------------------------------


def kernel_table(report: Report) -> list[str]:
    lines = [
        "## Kernels",
        "",
        "| kernel | case | dtype | max err | ok | us | torch us | GB/s | of copy | TFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["kernels"]:
        timing = "- | - | - | - | - |"
        if r["ms"]:
            timing = (
                f"{r['ms'] * 1e3:.1f} | {r['ref_ms'] * 1e3:.1f} | {r['gb_per_s']:.0f} | "
                f"{r['frac_of_copy']:.0%} | {r['tflops']:.1f} |"
            )
        ok = "yes" if r["ok"] else "**NO**"
        lines.append(
            f"| {r['name']} | {r['case']} | {r['dtype']} | {r['max_abs_err']:.1e} | {ok} | "
            + timing
        )
    sweep = report["decode_sweep"]
    verdict = "met" if sweep["meets_target"] else "**not met**"
    lines += [
        "",
        f"Paged-attention decode: {sweep['default_frac_of_copy']:.0%} of the measured "
        f"copy bandwidth ({sweep['default_us']:.0f} us), target {sweep['target']:.0%}: "
        f"{verdict}. Best tiling in the sweep: {sweep['best']}.",
        "",
    ]
    return lines


def e2e_table(report: Report) -> list[str]:
    lines = [
        "## Reference workload (SmolLM2-135M, greedy, all requests at once)",
        "",
        "| engine | dtype | s | output tok/s | skiff speed-up | TTFT p50 / p99 s "
        "| ITL p50 / p99 ms | greedy agreement |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["e2e"]:
        ttft, itl = r.get("ttft_s") or {}, r.get("itl_s") or {}
        agree = r.get("greedy_agreement_with_skiff")
        lines.append(
            f"| {r['engine']} | {r['dtype']} | {r['seconds']:.2f} | "
            f"{r['output_tokens_per_s']:.0f} | {r.get('skiff_speedup', 1.0):.2f} | "
            + (f"{ttft['p50']:.3f} / {ttft['p99']:.3f} | " if ttft else "- | ")
            + (f"{itl['p50'] * 1e3:.1f} / {itl['p99'] * 1e3:.1f} | " if itl else "- | ")
            + (
                f"{agree['exact']:.0%} exact, {agree['mean_common_prefix']:.0%} prefix |"
                if agree
                else "- |"
            )
        )
    return lines


def markdown(report: Report) -> str:
    lines = [
        f"# skiff GPU benchmark: {report['device']}",
        "",
        f"Measured copy bandwidth: {report['copy_gb_per_s']:.0f} GB/s.",
        "",
    ]
    if report.get("kernels"):
        lines += kernel_table(report)
    if report.get("e2e"):
        lines += e2e_table(report)
    return "\n".join(lines) + "\n"


def write_report(report: Report, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / time.strftime("gpu-%Y%m%d-%H%M%S")
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    stem.with_suffix(".md").write_text(markdown(report))
    return stem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes: a smoke run")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="end-to-end model dtypes")
    parser.add_argument("--hf-batch-sizes", default="32", help="transformers static batch sizes")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device on this machine; nothing to benchmark.")
        return 0
    os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels, whatever the shell says
    sys.path.insert(0, str(ROOT))
    sizes = Sizes.quick() if args.quick else Sizes()
    torch.manual_seed(0)
    report: Report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "sizes": asdict(sizes),
        "copy_gb_per_s": copy_bandwidth(),
    }
    torch.cuda.empty_cache()
    print(f"{report['device']}: copy bandwidth {report['copy_gb_per_s']:.0f} GB/s", flush=True)
    ok = True
    if not args.skip_kernels:
        results = elementwise_cases(sizes, report["copy_gb_per_s"])
        attention, report["decode_sweep"] = attention_cases(sizes, report["copy_gb_per_s"])
        results += attention
        report["kernels"] = [asdict(r) for r in results]
        ok = all(r.ok for r in results)
    if not args.skip_e2e:
        batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
        report["e2e"] = e2e(sizes, args.dtypes.split(","), batch_sizes)
    stem = write_report(report, args.out_dir)
    print(f"results: {stem}.json and .md" + ("" if ok else "\nKERNEL MISMATCH"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
