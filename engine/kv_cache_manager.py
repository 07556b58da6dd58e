"""Per-request block tables on top of the block pool, with prefix caching.

A request's KV lives in `block_ids[req_id]`: block `i` holds positions
`[i * block_size, (i + 1) * block_size)`. Full blocks are registered in the prefix
cache under a chained hash (sha256 of the parent hash and the block's tokens), so a
hit on block `i` implies the whole prefix up to it matches; the pool re-checks the
block's tokens on every hit.
"""

from __future__ import annotations

import hashlib

import numpy as np

from tandem.engine.block_pool import BlockPool
from tandem.engine.request import Request

_ROOT_HASH = b"tandem-prefix-root"


def root_hash(cache_salt: str | None) -> bytes:
    """The hash a prompt's first block chains from. A salted prompt's blocks hash apart
    from every prompt without the same salt, so only requests that share the salt share
    cached prefix blocks (nobody else can probe for them by timing)."""
    if not cache_salt:
        return _ROOT_HASH
    return hashlib.sha256(_ROOT_HASH + b"/salt/" + cache_salt.encode()).digest()


def chain_hash(parent: bytes, token_ids: tuple[int, ...] | list[int]) -> bytes:
    """Hash of a full block given its parent block's hash (stable across processes)."""
    digest = hashlib.sha256(parent)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.digest()


class KVCacheManager:
    """Allocates, shares, caches and frees the blocks of each request."""

    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_ids: dict[str, list[int]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up
        self.num_prefix_hits = 0  # prompt tokens found

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend `request.block_hashes` to cover the full blocks in `[0, num_tokens)`."""
        hashes = request.block_hashes
        size = self.block_size
        while (len(hashes) + 1) * size <= num_tokens:
            start = len(hashes) * size
            parent = hashes[-1] if hashes else root_hash(request.params.cache_salt)
            hashes.append(chain_hash(parent, request.token_ids(start, start + size)))

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks already holding a prefix of `request` (never its last token).

        The last prompt token is always recomputed, because its logits are needed to
        sample the next token; so at most `(num_tokens - 1) // block_size` blocks hit.
        """
        if not self.enable_prefix_caching:
            return []
        num_tokens = request.num_tokens
        self._update_hashes(request, num_tokens)
        hits: list[int] = []
        for i in range((num_tokens - 1) // self.block_size):
            start = i * self.block_size
            tokens = tuple(request.token_ids(start, start + self.block_size))
            block_id = self.pool.lookup(request.block_hashes[i], tokens)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup (for hit-rate metrics)."""
        self.num_prefix_queries += num_tokens
        self.num_prefix_hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> bool:
        """Make room for `num_new_tokens` more tokens (after `cached_blocks`, if any).

        Returns False, changing nothing, when the pool lacks free blocks.
        """
        cached_blocks = cached_blocks or []
        owned = self.block_ids.get(request.req_id, [])
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_needed - len(owned) - len(cached_blocks)
        num_reusable = self.pool.num_reusable(cached_blocks)
        if num_new_blocks + num_reusable > self.pool.num_free_blocks:
            return False
        self.pool.share(cached_blocks)
        new_blocks = self.pool.allocate(max(0, num_new_blocks)) or []
        self.block_ids[request.req_id] = owned + cached_blocks + new_blocks
        if cached_blocks:
            self._num_cached_blocks[request.req_id] = len(cached_blocks)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        done = self._num_cached_blocks.get(request.req_id, 0)
        if num_full <= done:
            return
        self._update_hashes(request, num_full * self.block_size)
        blocks = self.block_ids[request.req_id]
        for i in range(done, num_full):
            start = i * self.block_size
            tokens = tuple(request.token_ids(start, start + self.block_size))
            self.pool.cache(blocks[i], request.block_hashes[i], tokens)
        self._num_cached_blocks[request.req_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (cached blocks stay reusable)."""
        self.pool.free(self.take_blocks(request.req_id))

    def take_blocks(self, req_id: str) -> list[int]:
        """Forget the request's block table and return its blocks in the order to free
        them (tail first); the caller frees them, now or once no transfer pins them."""
        blocks = self.block_ids.pop(req_id, [])
        self._num_cached_blocks.pop(req_id, None)
        return list(reversed(blocks))
