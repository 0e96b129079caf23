"""Per-request KV block bookkeeping with prefix caching by chained block hashes, over a
worker's device pool and its lower tiers."""

from __future__ import annotations

from collections.abc import Iterator

from services.scheduler.block_pool import BlockPool, KVBlock
from services.scheduler.kv_tiers import LowerTiers
from services.scheduler.request import Request
from shared.arith import cdiv
from shared.prefix_hash import ROOT_HASH, iter_block_hashes


class KVCacheManager:
    """Maps requests to blocks of a BlockPool and keeps full blocks findable by hash."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        tiers: LowerTiers | None = None,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        # the worker's host and disk tiers (none without prefix caching)
        self.tiers = tiers if tiers is not None and enable_caching else LowerTiers(0, 0)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_block_hashes: dict[str, list[bytes]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request registered
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached
        self.step_id = 0  # the next plan: blocks cached (or offloaded) now are written by it

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """KV cache usage: the fraction of blocks held by requests (vLLM's kv_cache_usage)."""
        return self.pool.usage()

    def block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the request's full blocks, extended incrementally as tokens arrive."""
        hashes = self.req_block_hashes.setdefault(request.req_id, [])
        parent = hashes[-1] if hashes else request.prefix_root
        hashes.extend(
            iter_block_hashes(request.all_token_ids, self.block_size, len(hashes), parent)
        )
        return hashes

    def num_cached_prefix_blocks(self, token_ids: list[int], root: bytes = ROOT_HASH) -> int:
        """Leading full blocks of `token_ids` (a sequence whose first block's parent hash is
        `root`), in this manager's block size, found in the prefix cache (no side effects)."""
        if not self.pool.enable_caching:
            return 0
        num_hits = 0
        for block_hash in iter_block_hashes(token_ids, self.block_size, parent_hash=root):
            if self.pool.get_cached_block(block_hash) is None:
                break
            num_hits += 1
        return num_hits

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request, never covering its last token."""
        if not self.pool.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup: its tokens, and those its device
        cache held (vLLM's prefix_cache_queries and _hits)."""
        if not self.pool.enable_caching:
            return
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> list[int] | None:
        """Ensure room for `num_new_tokens` more tokens after the computed ones.

        `computed_blocks` are prefix-cache hits for a request being admitted. Returns the ids of
        blocks newly added to the request (hits included), or None if the pool is too small.
        """
        blocks = self.req_blocks.setdefault(request.req_id, [])
        if not computed_blocks:  # the common decode step: room left in the last block
            total_tokens = request.num_computed_tokens + num_new_tokens
            if total_tokens <= len(blocks) * self.block_size:
                self._cache_full_blocks(request, blocks, total_tokens)
                return []
        computed_blocks = computed_blocks or []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_needed = cdiv(total_tokens, self.block_size) - len(blocks) - len(computed_blocks)
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_evictable_hits:
            return None
        self.pool.touch(computed_blocks)
        new_blocks = computed_blocks + self.pool.allocate(max(num_needed, 0))
        blocks.extend(new_blocks)
        self._cache_full_blocks(request, blocks, total_tokens)
        return [b.block_id for b in new_blocks]

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        num_full = min(num_tokens, len(request.all_token_ids)) // self.block_size
        start = self.num_cached_blocks.get(request.req_id, 0)
        if num_full <= start or not self.pool.enable_caching:
            return
        hashes = self.block_hashes(request)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i], self.step_id)
        self.num_cached_blocks[request.req_id] = num_full

    def allocate_for_load(
        self, request: Request, computed_blocks: list[KVBlock], num_load_blocks: int
    ) -> list[KVBlock] | None:
        """The blocks of a request whose prefix continues in lower tiers: its prefix-cache hits
        and `num_load_blocks` new blocks to load that prefix into (cached only once loaded,
        by `commit_loaded`). Returns the new blocks, or None if the pool is too small."""
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_load_blocks > self.pool.num_free_blocks - num_evictable_hits:
            return None
        self.pool.touch(computed_blocks)
        new_blocks = self.pool.allocate(num_load_blocks)
        self.req_blocks[request.req_id] = computed_blocks + new_blocks
        self.num_cached_blocks[request.req_id] = len(computed_blocks)
        return new_blocks

    def commit_loaded(self, request: Request, ready_step: int) -> None:
        """The request's loaded blocks hold their KV (plan `ready_step` loaded them): make
        them findable by hash."""
        step, self.step_id = self.step_id, ready_step
        blocks = self.req_blocks[request.req_id]
        self._cache_full_blocks(request, blocks, len(blocks) * self.block_size)
        self.step_id = step

    def uncache_from(self, request: Request, num_tokens: int) -> None:
        """Take the request's blocks from the one holding token `num_tokens` on out of the
        prefix cache: they were cached when allocated, and their KV will not be computed."""
        start = num_tokens // self.block_size
        num_cached = self.num_cached_blocks.get(request.req_id, 0)
        for block in self.req_blocks.get(request.req_id, [])[start:num_cached]:
            self.pool.uncache(block)
        self.num_cached_blocks[request.req_id] = min(start, num_cached)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, keeping their hashes for reuse. Cached
        blocks no request holds any more are written down to the host tier, tail first, so
        that the head of a prefix, which every longer prefix needs, stays there longest."""
        blocks = self.req_blocks.pop(request.req_id, [])
        freed = self.pool.free(list(reversed(blocks)))
        self.num_cached_blocks.pop(request.req_id, None)
        if self.tiers.enabled:
            idle = [(b.block_id, b.block_hash) for b in freed if b.block_hash is not None]
            self.tiers.offload(idle, self.step_id)

    def forget(self, request: Request) -> None:
        """Drop all state of a finished request."""
        self.free(request)
        self.req_block_hashes.pop(request.req_id, None)

    def resident_block_hashes(self) -> Iterator[bytes]:
        """The hashes of every block this worker holds, in any tier."""
        yield from self.pool.cached
        yield from self.tiers.hashes()

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request.req_id, [])]
