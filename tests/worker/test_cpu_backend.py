"""The CPU attention backend, through the C++ op `skiff_cpu::paged_attention` and through plain
torch (C++ ops off), against the plain per-request reference, on mixed batches."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops
from kernels.reference import paged_attention
from services.worker.attention import AttentionMetadata
from services.worker.attention.cpu_backend import CpuAttentionBackend


@pytest.mark.parametrize("backend", ["torch", "cpu_ops"])
@pytest.mark.parametrize(("seed", "heads", "kv_heads", "dim"), [(0, 6, 2, 32), (1, 6, 2, 32),
                         (2, 9, 3, 64), (3, 4, 4, 80)])  # fmt: skip
def test_mixed_batch_matches_reference(backend, seed, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(seed)
    bs, num_blocks = 16, 96
    # decodes of very different lengths (several groups), a fresh prefill, a chunk after context
    q_lens = [1, 1, 1, 1, 1, 23, 9, 1]
    ctx = [3, 150, 140, 40, 17, 0, 37, 300]
    seq_lens = [c + q for c, q in zip(ctx, q_lens, strict=True)]
    perm = torch.randperm(num_blocks, generator=gen)
    table, used = torch.zeros(len(q_lens), 20, dtype=torch.int32), 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // bs)
        table[i, :nb] = perm[used : used + nb]
        used += nb
    kv_cache = torch.randn(2, num_blocks, bs, kv_heads, dim, generator=gen)
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, heads, dim, generator=gen)
    k = torch.randn(num_tokens, kv_heads, dim, generator=gen)
    v = torch.randn(num_tokens, kv_heads, dim, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.cat(
        [
            torch.tensor([int(table[i, p // bs]) * bs + p % bs for p in range(c, c + n)])
            for i, (c, n) in enumerate(zip(ctx, q_lens, strict=True))
        ]
    )
    meta = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table,
        slot_mapping=slots,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
    )
    cache_ref = kv_cache.clone()
    assert cpu_ops.load()
    cpu_ops.use(backend == "cpu_ops")
    try:
        out = CpuAttentionBackend().forward(q, k, v, kv_cache, meta, scale=dim**-0.5)
    finally:
        cpu_ops.use(True)
    if backend == "torch":
        assert len(meta.backend_state.decodes) >= 3
    else:
        assert meta.backend_state is None  # the C++ op ran, not the torch fallback
    flat = cache_ref.view(2, -1, kv_heads, dim)
    flat[0, slots], flat[1, slots] = k, v
    ref = paged_attention(q, cache_ref, qsl, meta.seq_lens, table, dim**-0.5)
    torch.testing.assert_close(kv_cache, cache_ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
