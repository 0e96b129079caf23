"""The KV block pool of one worker: ref counts, an LRU free list and the prefix-cache index."""

from __future__ import annotations

from collections import OrderedDict


class KVBlock:
    __slots__ = ("block_hash", "block_id", "ready_step", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set once the block is full and cached
        self.ready_step = -1  # the plan that computes (or loads) its cached content

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Fixed set of blocks. A block with ref_cnt 0 sits in the free list, which is ordered by
    the time it was freed: allocation takes (and evicts the cached hash of) the oldest first,
    so recently used prefixes survive longest.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, KVBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling idle ones out of the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > len(self.free_queue):
            raise ValueError(f"need {num_blocks} blocks, {len(self.free_queue)} free")
        out: list[KVBlock] = []
        for _ in range(num_blocks):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: list[KVBlock]) -> list[KVBlock]:
        """Drop one reference each; blocks reaching zero join the free list's young end in the
        order given (callers pass a request's tail first so tails are evicted before heads).
        Returns the blocks that became free."""
        freed: list[KVBlock] = []
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = None
                freed.append(block)
        return freed

    def cache_block(self, block: KVBlock, block_hash: bytes, ready_step: int) -> None:
        """Make a full block findable by hash; plan `ready_step` computes its content."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.ready_step = ready_step
        self.cached.setdefault(block_hash, block)

    def uncache(self, block: KVBlock) -> None:
        """Take a block out of the prefix-cache index: its KV will not match its hash."""
        self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
