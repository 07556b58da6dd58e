"""The paged KV cache's block pool: free list, reference counts, prefix-cache index.

Every KV block is either referenced by one or more requests (`ref_cnt > 0`) or free.
Free blocks sit in an LRU queue; a free block may still hold a cached prefix (it keeps
its hash) and is evicted only when the allocator hands it out again. So "free" means
"reusable", and an idle engine has `num_free_blocks == num_blocks`.

Allocators return a result or `None`; they never preempt (only the scheduler does).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class CachedBlock:
    """What the prefix cache remembers about a full block."""

    block_id: int
    # The block's own tokens, compared on every hit so a hash collision cannot alias.
    token_ids: tuple[int, ...]


class BlockPool:
    """Owns `num_blocks` KV blocks: allocation, sharing and LRU eviction."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_cnt = [0] * num_blocks
        # Block id -> its prefix-cache hash, for blocks that are in the cache.
        self._block_hash: dict[int, bytes] = {}
        self._cache: dict[bytes, CachedBlock] = {}
        # Free blocks, least recently used first (evicted first).
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cache)

    def ref_cnt(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def allocate(self, num: int) -> list[int] | None:
        """Take `num` free blocks (evicting cached prefixes, LRU first), or None."""
        if num > len(self._free):
            return None
        block_ids = []
        for _ in range(num):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> int | None:
        """The cached block holding exactly `token_ids` under `block_hash`, if any."""
        cached = self._cache.get(block_hash)
        if cached is None or cached.token_ids != token_ids:
            return None
        return cached.block_id

    def num_reusable(self, block_ids: list[int]) -> int:
        """How many of `block_ids` are free now (taking them shrinks the free list)."""
        return sum(1 for b in block_ids if self._ref_cnt[b] == 0)

    def share(self, block_ids: list[int]) -> None:
        """Add a reference to each block (prefix-cache hits), pulling free ones out of LRU."""
        for block_id in block_ids:
            if self._ref_cnt[block_id] == 0:
                del self._free[block_id]
            self._ref_cnt[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; unreferenced blocks become free (MRU end).

        Callers pass a request's blocks in reverse order so that, among one request's
        blocks, the tail of the sequence is evicted before its (more shareable) head.
        """
        for block_id in block_ids:
            count = self._ref_cnt[block_id]
            if count <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            self._ref_cnt[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None

    def cache(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Register a full, computed block under its chained hash (first writer wins)."""
        if block_hash in self._cache or block_id in self._block_hash:
            return
        self._cache[block_hash] = CachedBlock(block_id, token_ids)
        self._block_hash[block_id] = block_hash

    def _evict(self, block_id: int) -> None:
        block_hash = self._block_hash.pop(block_id, None)
        if block_hash is not None:
            del self._cache[block_hash]
            self.num_evictions += 1
