"""Prefix lookups of the KV cache manager without side effects, in its own block size."""

from __future__ import annotations

from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request
from shared.prefix_hash import iter_block_hashes
from shared.sampling_params import SamplingParams


def cached_manager(token_ids: list[int], block_size: int, caching: bool = True) -> KVCacheManager:
    """A manager holding the full blocks of `token_ids` in its prefix cache, all free."""
    kv = KVCacheManager(num_blocks=16, block_size=block_size, enable_caching=caching)
    request = Request("r", list(token_ids), SamplingParams())
    assert kv.allocate_slots(request, len(token_ids)) is not None
    kv.forget(request)
    return kv


def test_num_cached_prefix_blocks_counts_the_leading_run_in_its_block_size():
    tokens = list(range(100, 150))  # 3 full blocks of 16, 1 of 32
    kv16, kv32 = cached_manager(tokens, 16), cached_manager(tokens, 32)
    assert kv16.num_cached_prefix_blocks(tokens) == 3
    assert kv32.num_cached_prefix_blocks(tokens) == 1
    diverged = tokens[:20] + [0] * 30  # differs in the second block of 16
    assert kv16.num_cached_prefix_blocks(diverged) == 1
    assert kv32.num_cached_prefix_blocks(diverged) == 0
    assert kv16.num_free_blocks == kv16.num_blocks and kv16.usage == 0.0
    assert kv16.prefix_queries == 0  # a lookup for placement is not a prefix-cache query


def test_lookup_hashes_as_the_manager_does():
    tokens = list(range(40))
    kv = KVCacheManager(num_blocks=8, block_size=16)
    request = Request("r", tokens[:20], SamplingParams())
    kv.block_hashes(request)  # one full block so far
    request.append_output_token(tokens[20])
    for t in tokens[21:]:
        request.append_output_token(t)
    assert kv.block_hashes(request) == list(iter_block_hashes(tokens, 16))


def test_no_hits_without_prefix_caching():
    tokens = list(range(64))
    assert cached_manager(tokens, 16, caching=False).num_cached_prefix_blocks(tokens) == 0
