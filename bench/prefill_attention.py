"""CPU prefill attention: the C++ op `skiff_cpu::paged_attention` on one prefill chunk, and
the whole prefill through `LLM.generate`.

    python bench/prefill_attention.py [--lengths 512 2048 8192] [--repeats 3]
    python bench/prefill_attention.py --generate [--lengths 512 2048 6000]

Op: SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, block_size 16)
over one fresh prompt of each length, best of `--repeats`, two ways through the same op:
`per-token`, every token a request of its own (one query token against its context, the
decode path: each key read once per query token), and `tiled`, the prompt as one prefill
chunk (blocks of query rows against tiles of keys). Both are checked against each other.

`--generate`: the default model on one prompt of each length, `max_tokens=1`, prefix caching
off, the prompt scheduled as one chunk; prints prompt tok/s, best of `--repeats`.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kernels import cpu_ops  # noqa: E402
from shared.arith import cdiv  # noqa: E402

if TYPE_CHECKING:
    from services.offline import LLM

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def best_of(repeats: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def op_times(length: int, repeats: int) -> tuple[float, float]:
    """Seconds of the op (per-token, tiled) on one `length`-token prompt."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = cdiv(length, BLOCK_SIZE)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    slots = cache.flatten(1, 2)  # [2, num_slots, kv_heads, head_dim]
    query = torch.randn(length, HEADS, HEAD_DIM, generator=gen)
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32)[None]  # [1, num_blocks]
    scale = HEAD_DIM**-0.5

    def run(qsl: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.skiff_cpu.paged_attention(
            query, slots[0], slots[1], qsl, seq_lens, tables, scale, BLOCK_SIZE
        )
        return out

    tiled = (
        torch.tensor([0, length], dtype=torch.int32),
        torch.tensor([length], dtype=torch.int32),
        table,
    )
    per_token = (
        torch.arange(length + 1, dtype=torch.int32),
        torch.arange(1, length + 1, dtype=torch.int32),
        table.expand(length, -1).contiguous(),
    )
    torch.testing.assert_close(run(*tiled), run(*per_token), rtol=1e-5, atol=1e-5)
    return best_of(repeats, lambda: run(*per_token)), best_of(repeats, lambda: run(*tiled))


def generate_rate(llm: LLM, length: int, repeats: int) -> float:
    """Prompt tok/s of one `length`-token prompt and one output token."""
    from services.offline import SamplingParams

    rng = random.Random(length)
    prompt = [rng.randrange(1000, 40000) for _ in range(length)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    return length / best_of(repeats, lambda: llm.generate([prompt], params))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--generate", action="store_true")
    args = parser.parse_args()
    assert cpu_ops.load(), "the C++ CPU ops do not build or run here"
    if args.generate:
        from services.offline import LLM

        lengths = args.lengths or [512, 2048, 6000]
        llm = LLM(
            enable_prefix_caching=False,
            max_num_batched_tokens=max(lengths),
            max_model_len=max(lengths) + 16,
        )
        for n in lengths:
            print(
                f"generate {n:5d} tokens: {generate_rate(llm, n, args.repeats):7.1f} prompt tok/s"
            )
        return
    for n in args.lengths or [512, 2048, 8192]:
        per_token, tiled = op_times(n, args.repeats)
        print(
            f"op {n:5d} tokens: per-token {per_token * 1e3:8.1f} ms, tiled {tiled * 1e3:8.1f} ms "
            f"({per_token / tiled:4.1f}x)"
        )


if __name__ == "__main__":
    main()
