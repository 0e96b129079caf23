"""CPU decode steps with LoRA adapters, timed alone: the fused decode path
(services/worker/cpu_decode.py) on one step of `--requests` requests at context `--context`,
with no adapter, with one adapter for all requests, and with the requests spread over 16
adapters (rank 16 on all seven projections, 16 slots), one step of each in turn.

    python bench/lora_step.py [--requests 32] [--context 200] [--rounds 30] [--cpu-time]

Prints each spread's best and median step time over the rounds and the base's best over its
best (the throughput ratio; the best is the least disturbed by other processes). With
`--cpu-time`, the process's CPU time (all threads) instead of the wall time: steadier on a busy
machine; run it with OMP_WAIT_POLICY=passive so that waiting threads do not spin. The step's
KV cache is left as it is: its values do not change the work.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.lora import RANK, write_adapter
from kernels.lora_mapping import LoRAMapping
from services.offline import LLM
from services.worker.attention import AttentionMetadata
from shared.arith import cdiv

SLOTS = 16


def step_inputs(
    requests: int, context: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids [B], positions [B], metadata) of a decode step: request b owns blocks
    [b n, (b + 1) n) and its new token is the last of `context`."""
    n = cdiv(context, block_size)
    block_table = torch.arange(requests * n, dtype=torch.int32).view(requests, n)
    last = context - 1
    slot_mapping = block_table[:, last // block_size].long() * block_size + last % block_size
    meta = AttentionMetadata(
        query_start_loc=torch.arange(requests + 1, dtype=torch.int32),
        seq_lens=torch.full((requests,), context, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=slot_mapping,
        max_query_len=1,
        max_seq_len=context,
    )
    input_ids = torch.randint(100, 1000, (requests,))
    return input_ids, torch.full((requests,), last), meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--cpu-time", action="store_true", help="time CPU time, not wall time")
    args = p.parse_args()
    llm = LLM(enable_lora=True, max_loras=SLOTS, max_lora_rank=RANK, max_num_seqs=args.requests)
    runner, fused = llm.runner, llm.runner.fused_cpu_decode
    assert runner.lora is not None and fused is not None and fused.runs_lora
    with tempfile.TemporaryDirectory(prefix="skiff-bench-lora-step-") as tmp:
        adapters = [
            write_adapter(Path(tmp), f"a{i}", runner.model_config, RANK, i) for i in range(SLOTS)
        ]
        slots = [runner.lora.load(a) for a in adapters]
    input_ids, positions, meta = step_inputs(args.requests, args.context, fused.block_size)
    b = args.requests
    spreads: dict[str, LoRAMapping | None] = {
        "base": None,
        "1 adapter": LoRAMapping.build(torch.full((b,), slots[0])),
        "16 adapters": LoRAMapping.build(torch.tensor([slots[i % SLOTS] for i in range(b)])),
    }
    clock = time.process_time if args.cpu_time else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in spreads}
    with torch.inference_mode():
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, mapping in spreads.items():
                start = clock()
                fused.forward(input_ids, positions, meta, mapping)
                times[name].append((clock() - start) * 1e3)
    llm.close()
    base = min(times["base"][1:])
    threads, what = torch.get_num_threads(), "CPU" if args.cpu_time else "wall"
    print(f"decode step, {b} requests at context {args.context}, {threads} threads, {what} time:")
    for name, ms in times.items():
        best, median = min(ms[1:]), statistics.median(ms[1:])
        print(f"  {name:<12} best {best:6.1f} ms, median {median:6.1f} ms, {base / best:.2f}x base")


if __name__ == "__main__":
    main()
