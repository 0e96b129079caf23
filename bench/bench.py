"""`make bench`: skiff against transformers `generate` on the reference workload.

Peers run side by side in this one process and are reported as ratios, never against a fixed
number: the machine is shared and noisy. Sections: the offline engine vs transformers static
batches, single-request decode speed, llama.cpp's `llama-server` on the same workload through
the same client at each --llama-cpp-slots and its `llama-bench` single-stream decode
(--no-llama-cpp skips it; built once, see bench/llamacpp.py), the HTTP path through a real
stack (--no-served skips it; served and in process then take turns, the stack up, and each
keeps the best of SERVED_ROUNDS runs of the workload), the sampler's cost
per step (--no-sampler skips it), LoRA adapters (bench/lora.py, --no-lora skips it) and the
served path with NATS TLS on against off (bench/tls.py, --no-tls skips it). The machine's
fp32 GEMM GFLOP/s and memory bandwidth are measured in the same run.
Writes bench/results/cpu-<family>.json and cpu-<family>.txt (what it printed), one pair per CPU
family (`roofline.family_slug`: vendor, brand, AMD's Zen generation, widest extension tier,
e.g. cpu-intel-xeon-amx, cpu-amd-epyc-zen4-avx512), cpu-throughput.png (output throughput
against concurrency: the served path at each --served-concurrency, transformers at each static
batch size, the offline engine with every request at once, llama-server at each slot count) and
cpu-latency.png (the served path's TTFT and inter-token latency CDFs). The long-prompt section
(bench/long_prompts.py, --no-long-prompts skips it) measures prefill at 512, 2k and 8k prompt
tokens in process and served, against llama.cpp's `llama-bench -p` and `llama-server`, and the
ITL of running streams while an 8k prompt is admitted. With llama.cpp, the precision section
(bench/precision.py) puts skiff's fp32 / bf16 / bf16_dot / int8 / q8_0 weights against
llama.cpp's F32 / BF16 / Q8_0 GGUFs (decode speed, greedy agreement with each engine's
fp32) and writes cpu-precision.md beside the JSON. The last lines are `prefill ratio vs
llama.cpp at 2k: X.XX` and `prefill ratio vs llama.cpp at 8k: X.XX` (skiff's in-process
prefill tokens/s /
llama-bench's), `throughput ratio vs llama.cpp: X.XX` (skiff served / llama-server at its best
slot count), `single-stream ratio vs llama.cpp: X.XX` (skiff's decode steps of one request,
prefill excluded as llama-bench's tg64 excludes it / llama-bench tg64; the two take turns three
times and each keeps its best), the precision section's (`int8 speed vs llama.cpp Q8_0: X.XX
(...)` and the agreements next to Q8_0's among them) and `throughput ratio vs transformers:
X.XX`, after a `cpu: ...` line naming the CPU, its extensions and the ISA of skiff's C++
kernels, with `lora throughput ratio 16 adapters / base: X.XX` and `served throughput ratio NATS
TLS on / off: X.XX` before the last.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import llamacpp, long_prompts, precision, roofline  # noqa: E402
from bench.cpu_step import decode_only, engine_run, tg_prompt  # noqa: E402
from bench.plots import plot_throughput  # noqa: E402
from bench.sampler_bench import DecodeShare, SamplerRow  # noqa: E402
from bench.workload import reference_workload  # noqa: E402
from services.offline import LLM  # noqa: E402

if TYPE_CHECKING:
    from transformers import GenerationMixin


def hf_static_batches(
    model: GenerationMixin,
    prompts: list[list[int]],
    outputs: list[int],
    batch_size: int,
    pad_id: int,
) -> float:
    """Seconds to serve all requests with static batches of `batch_size`, left-padded; each
    batch runs until its longest requested output. Only requested tokens count as useful."""
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk, wants = prompts[i : i + batch_size], outputs[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max(wants),
                min_new_tokens=max(wants),
                pad_token_id=pad_id,
            )
    return time.perf_counter() - start


SINGLE_STREAM_ROUNDS = 3
SERVED_ROUNDS = 3  # the workload served and in process, in turns: each keeps its best


def single_decode(
    llm: LLM, hf_model: GenerationMixin, prompt: list[int], new_tokens: int
) -> tuple[float, float]:
    """Output tokens/s of one request alone (prefill included, short prompt)."""
    t_engine, n = engine_run(llm, [prompt], [new_tokens])
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    with torch.no_grad():
        hf_model.generate(
            input_ids=ids,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    t_hf = time.perf_counter() - start
    return n / t_engine, new_tokens / t_hf


class Tee(io.TextIOBase):
    """Writes through to `stream` and keeps a copy in `text`."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.text = stream, io.StringIO()

    def write(self, s: str) -> int:
        self.stream.write(s)
        return self.text.write(s)

    def flush(self) -> None:
        self.stream.flush()


def precision_section(args: argparse.Namespace) -> precision.Precision | None:
    """bench/precision.py at the llama.cpp thread counts (None, saying why, where llama.cpp
    fails on a GGUF type the F32 run did not need)."""
    threads = [int(x) for x in args.llama_cpp_threads.split(",")]
    try:
        return precision.run(threads, args.requests, version=args.llama_cpp_version)
    except llamacpp.LlamaCppUnavailable as e:
        print(f"llama.cpp precision section skipped, failed: {e}")
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--hf-batch-sizes", default="1,8,32")
    p.add_argument(
        "--hf-batch1-requests",
        type=int,
        default=8,
        help="batch 1 is slow: time it on this many requests (a rate, so comparable)",
    )
    p.add_argument(
        "--no-served",
        dest="served",
        action="store_false",
        help="skip the HTTP path through a real stack",
    )
    p.add_argument(
        "--served-concurrency",
        default="1,8,32",
        help="requests in flight on the served path, one run each",
    )
    p.add_argument(
        "--no-sampler", dest="sampler", action="store_false", help="skip the sampler section"
    )
    p.add_argument(
        "--no-lora",
        dest="lora",
        action="store_false",
        help="skip the LoRA section (the workload over 1, 4 and 16 adapters vs base only)",
    )
    p.add_argument(
        "--no-tls",
        dest="tls",
        action="store_false",
        help="skip the served workload with NATS TLS on against off (two stacks, in turns)",
    )
    p.add_argument(
        "--no-llama-cpp",
        dest="llama_cpp",
        action="store_false",
        help="skip llama.cpp (llama-server on the workload, llama-bench single stream, the "
        "precision section)",
    )
    p.add_argument(
        "--llama-cpp-slots",
        default="8,16,32",
        help="llama-server slot counts (-np) to try; the best is compared",
    )
    p.add_argument(
        "--llama-cpp-threads",
        default=str(llamacpp.physical_cores()),
        help="llama.cpp thread counts (-t) to try (default: physical cores); the best is compared",
    )
    p.add_argument("--llama-cpp-version", default=llamacpp.LLAMA_CPP_PYTHON_VERSION)
    p.add_argument(
        "--no-long-prompts",
        dest="long_prompts",
        action="store_false",
        help="skip the long-prompt section (prefill at 512/2k/8k tokens, ITL under an 8k one)",
    )
    p.add_argument(
        "--out",
        help="results JSON (default bench/results/cpu-<family>.json); the printed lines go "
        "beside it, .txt",
    )
    args = p.parse_args()
    out = Path(args.out) if args.out else roofline.results_path(roofline.cpu_summary(), ".json")
    printed = Tee(sys.stdout)
    with contextlib.redirect_stdout(printed):
        run(args, out)
    out.with_suffix(".txt").write_text(printed.text.getvalue())


def run(args: argparse.Namespace, out: Path) -> None:
    """The sections, the report and the results JSON at `out`."""
    torch.manual_seed(0)

    from transformers import AutoModelForCausalLM

    llm = LLM(enable_prefix_caching=False)  # as the served path: no run reuses another's KV
    model_dir = llm.runner.config.model_dir
    llama, llama_missing = None, "--no-llama-cpp"
    if args.llama_cpp:  # build/convert first: never while something is being timed
        try:
            llama = llamacpp.prepare(Path(model_dir), args.llama_cpp_version)
        except llamacpp.LlamaCppUnavailable as e:
            llama_missing = f"cannot be built: {e}"
            print(f"llama.cpp skipped, {llama_missing}")
    machine = roofline.measure()
    linear = machine["cpu_linear_gflops"]
    cpu_line = roofline.cpu_line()  # the CPU, its extensions, the kernels' ISA
    print(cpu_line)
    print(
        f"machine: fp32 GEMM {machine['fp32_gemm_gflops']:.0f} GFLOP/s "
        f"(torch), {'n/a' if linear is None else f'{linear:.0f}'} GFLOP/s (skiff_cpu::linear, "
        f"{machine['kernels_isa']}, 256 x 1024 x 1024), "
        f"copy bandwidth {machine['copy_bandwidth_gbs']:.1f} GB/s, "
        f"read bandwidth {machine['read_bandwidth_gbs']:.1f} GB/s, "
        f"load average {machine['load_average_1m']:.1f}"
    )
    prompts, outputs = reference_workload(llm.tokenizer, args.requests)
    useful = sum(outputs)
    print(
        f"workload: {len(prompts)} requests, prompt tokens {sum(map(len, prompts))}, "
        f"output tokens {useful}, torch threads {torch.get_num_threads()}"
    )
    engine_run(llm, prompts[:2], [4, 4])  # warm-up
    rows: list[tuple[str, float]] = []
    t, n = engine_run(llm, prompts, outputs)
    assert n == useful, (n, useful)
    rows.append(("skiff LLM.generate", useful / t))

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.eval()  # type: ignore[no-untyped-call]  # transformers leaves it untyped
    pad_id = llm.tokenizer.eos_token_id or 0
    hf_rates = {}
    for bs in (int(x) for x in args.hf_batch_sizes.split(",")):
        count = args.hf_batch1_requests if bs == 1 else len(prompts)
        t = hf_static_batches(hf, prompts[:count], outputs[:count], bs, pad_id)
        hf_rates[bs] = sum(outputs[:count]) / t
        rows.append(
            (
                f"transformers generate, static batch {bs}"
                + (f" ({count} requests)" if count != len(prompts) else ""),
                hf_rates[bs],
            )
        )

    prompt = tg_prompt(llm.tokenizer)
    ours_single, hf_single = single_decode(llm, hf, prompt, 128)
    ours_tg = decode_only(llm, prompt)

    peers = {
        "skiff LLM.generate (all at once)": {len(prompts): rows[0][1]},
        "transformers generate (static batches)": hf_rates,
    }
    llama_rates: dict[tuple[int, int], float] = {}
    llama_singles: dict[int, float] = {}
    if llama:
        threads = [int(x) for x in args.llama_cpp_threads.split(",")]
        slot_counts = [int(x) for x in args.llama_cpp_slots.split(",")]
        try:
            llama_rates = llamacpp.serve_workload(
                llama, prompts, outputs, slot_counts, threads, Path("/tmp/skiff-bench")
            )
        except llamacpp.LlamaCppUnavailable as e:
            llama_missing = f"failed: {e}"
            print(f"llama.cpp served skipped, {llama_missing}")
        # Single stream is bound by memory bandwidth, which drifts on a shared machine: the
        # two engines take turns, SINGLE_STREAM_ROUNDS times, and each keeps its best.
        for _ in range(SINGLE_STREAM_ROUNDS):
            try:
                for t, rate in llamacpp.single_stream(llama, threads).items():
                    llama_singles[t] = max(llama_singles.get(t, 0.0), rate)
            except llamacpp.LlamaCppUnavailable as e:
                llama_missing = f"failed: {e}"
                print(f"llama.cpp single stream skipped, {llama_missing}")
                break
            ours_tg = max(ours_tg, decode_only(llm, prompt))
    llama_single = max(llama_singles.values(), default=None)
    if llama_rates:
        slots, threads_best = max(llama_rates, key=llama_rates.__getitem__)
        name = f"llama.cpp llama-server ({slots} slots, {threads_best} threads)"
        rows.append((name, llama_rates[slots, threads_best]))
        for t in sorted({t for _, t in llama_rates}):
            series = {s: r for (s, t2), r in llama_rates.items() if t2 == t}
            peers[f"llama.cpp llama-server, {t} threads (x = slots, all at once)"] = series
    out_dir = out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    served = None
    if args.served:
        from bench.served import plot_served, run_served

        concurrencies = [int(c) for c in args.served_concurrency.split(",")]

        def in_process_turn() -> None:
            t, _ = engine_run(llm, prompts, outputs)
            rows[0] = (rows[0][0], max(rows[0][1], useful / t))

        # Served and in process take turns; each keeps its best of SERVED_ROUNDS runs.
        served, samples = run_served(
            model_dir, prompts, outputs, concurrencies, True, SERVED_ROUNDS, in_process_turn
        )
        rows.append(("skiff served (HTTP -> NATS -> worker)", served["tokens_per_s"]))
        peers["skiff LLM.generate (all at once)"] = {len(prompts): rows[0][1]}
        served["vs_in_process"] = served["tokens_per_s"] / rows[0][1]
        plots = plot_served(samples, served, out_dir, "cpu", peers)
    else:
        plots = [plot_throughput(peers, out_dir / "cpu-throughput.png", "output throughput")]

    long = None
    if args.long_prompts:
        llama_threads = [int(x) for x in args.llama_cpp_threads.split(",")]
        long = long_prompts.run(
            llm, llama, llama_threads, served=args.served, llama_missing=llama_missing
        )

    lora = None
    if args.lora:
        from bench import lora as lora_bench

        lora = lora_bench.run(prompts, outputs)

    tls = None
    if args.tls:
        from bench import tls as tls_bench

        tls = tls_bench.run(model_dir, prompts, outputs)

    by_precision = precision_section(args) if llama else None

    sampler: tuple[list[SamplerRow], DecodeShare] | None = None
    if args.sampler:
        from bench.sampler_bench import report, run_sampler_bench

        del llm, hf  # free memory before the sampler section loads its own engine
        sampler = run_sampler_bench()

    best_hf = max(hf_rates.values())
    print(f"\n{'path':<52} {'output tok/s':>12} {'vs best HF':>10}")
    for name, rate in rows:
        print(f"{name:<52} {rate:>12.1f} {rate / best_hf:>9.2f}x")
    print(
        f"\nsingle request decode (16-token prompt, 128 new): skiff {ours_single:.1f} tok/s, "
        f"transformers {hf_single:.1f} tok/s, ratio {ours_single / hf_single:.2f}"
    )
    print(f"single stream decode steps only (as tg64, 16-token prompt): skiff {ours_tg:.1f} tok/s")
    for t, rate in llama_singles.items():
        print(f"single stream decode, llama.cpp llama-bench tg64, {t} threads: {rate:.1f} tok/s")
    if served:
        print(f"served / in-process throughput: {served['vs_in_process']:.2f}")
        print(json.dumps(served, indent=2))
    if long:
        print("\n".join(long.report()))
    if sampler:
        print("\nsampler per step (batched vs a naive per-request loop, same run):")
        report(*sampler)
    if tls:
        print("\nserved workload, NATS TLS on against off (bench/tls.py):")
        print("\n".join(tls.report()[:-1]))
    if by_precision:
        print("\nskiff and llama.cpp at each precision (bench/precision.py):")
        print("\n".join(by_precision.report()))
        precision.write_markdown(by_precision, cpu_line, out.parent / precision.MARKDOWN.name)
    out.write_text(
        json.dumps(
            {
                "rows": rows,
                "single_decode": {
                    "skiff": ours_single,
                    "skiff decode steps only (tg64)": ours_tg,
                    "transformers": hf_single,
                    "llama.cpp tg64": llama_single,
                },
                "served": served,
                "llama_cpp": {
                    "version": args.llama_cpp_version,
                    "served": {f"np {s}, t {t}": r for (s, t), r in llama_rates.items()},
                    "single_stream_tg64_by_threads": llama_singles,
                    "missing": None if llama_rates and llama_single else llama_missing,
                },
                "machine": machine,
                "long_prompts": long.as_json() if long else None,
                "sampler": [*sampler[0], sampler[1]] if sampler else None,
                "lora": lora,
                "tls": tls.as_json() if tls else None,
                "precision": by_precision.as_json() if by_precision else None,
            },
            indent=2,
        )
    )
    print("plots: " + ", ".join(str(p) for p in plots))
    skiff_served = served["tokens_per_s"] if served else None
    best_llama = max(llama_rates.values()) if llama_rates else None
    print(cpu_line)
    if long:
        print("\n".join(long.ratio_lines()))
    for line in llamacpp.ratio_lines(
        skiff_served, best_llama, ours_tg, llama_single, llama_missing
    ):
        print(line)
    if by_precision:
        print("\n".join(by_precision.ratio_lines()))
    if lora:
        print(f"lora throughput ratio 16 adapters / base: {lora['16 adapters / base']:.2f}")
    if tls:
        print(tls.ratio_line())
    print(f"throughput ratio vs transformers: {rows[0][1] / best_hf:.2f}")


if __name__ == "__main__":
    main()
