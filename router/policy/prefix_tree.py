"""The router's approximate copy of one worker's prefix cache.

Workers do not report what they cache, so the router remembers what it sent: each
prompt's full blocks, hashed exactly as the engine hashes them (`chain_hash` over
`block_size` tokens, chained from the engine's root), so block `i`'s hash names the
whole prefix up to it. The index is a set of such hashes; since a hash implies its
parents, the set *is* a prefix tree and matching is a walk down the prompt's chain.

Semantics (mirroring the engine's block pool):

- `insert(ids, req_id)` records that the worker will hold every full block of `ids`
  and marks them most recently used, leaf first and root last. Because a parent is
  touched after each of its children, a parent is always more recent than any child
  and LRU eviction removes leaves first: the index stays prefix-closed.
- *Locks*: blocks inserted under a `req_id` are locked (ref-counted) until
  `unlock(req_id)`, as the worker pins them while it runs the request or holds its KV
  under a lease. Locked blocks count toward capacity but are never evicted; if the
  locked blocks alone exceed capacity the index stays over capacity until unlocks
  (the worker would be queueing then). Locks cover whole chains, so skipping locked
  blocks during eviction keeps the index prefix-closed too.
- *Eviction*: when more than `capacity_blocks` are held, the least recently used
  unlocked blocks go first. Capacity is the worker's `num_blocks` (from `Stats`): its
  cache competes with running requests for the same pool, so this over-estimates what
  survives under load; a mismatch costs one wrong guess, never correctness.
- `match_len(ids)` is read-only (scoring every worker must not refresh anyone's LRU)
  and, like the engine, never counts the last prompt token: it is always recomputed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# The engine's hashing: the router's hashes equal the workers' (so a future KV-event
# feed from workers can be merged into this index).
from tandem.engine.kv_cache_manager import chain_hash, root_hash


def block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[bytes]:
    """Chained hashes of every full block of `token_ids`, as the engine computes them
    (a salted prompt's from the salted root)."""
    hashes: list[bytes] = []
    parent = root_hash(cache_salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, list(token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """Which prompt prefixes one worker likely has cached (LRU, bounded, lockable)."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        # Block hash -> None, least recently used first.
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        # Block hash -> number of requests locking it.
        self._lock_cnt: dict[bytes, int] = {}
        # Request id -> the hashes it locked.
        self._locks: dict[str, list[bytes]] = {}
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def num_locked_blocks(self) -> int:
        return len(self._lock_cnt)

    @property
    def num_locked_requests(self) -> int:
        return len(self._locks)

    def hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        return block_hashes(token_ids, self.block_size)

    def match_blocks(self, hashes: Sequence[bytes], num_tokens: int) -> int:
        """Leading blocks of a prompt (given its hashes and length) present here."""
        max_blocks = max(0, (num_tokens - 1) // self.block_size)
        count = 0
        for h in hashes[:max_blocks]:
            if h not in self._lru:
                break
            count += 1
        return count

    def match_len(self, token_ids: Sequence[int], hashes: Sequence[bytes] | None = None) -> int:
        """Prompt tokens likely served from this worker's prefix cache (read-only)."""
        if hashes is None:
            hashes = self.hashes(token_ids)
        return self.match_blocks(hashes, len(token_ids)) * self.block_size

    def insert(
        self,
        token_ids: Sequence[int],
        req_id: str | None = None,
        hashes: Sequence[bytes] | None = None,
    ) -> None:
        """Record that the worker now holds `token_ids`' full blocks; lock them for `req_id`."""
        if req_id is not None and req_id in self._locks:
            raise ValueError(f"request {req_id!r} already holds a lock")
        if hashes is None:
            hashes = self.hashes(token_ids)
        for h in reversed(hashes):  # leaf first, so the root ends most recent
            self._lru[h] = None
            self._lru.move_to_end(h)
        if req_id is not None and hashes:
            self._locks[req_id] = list(hashes)
            for h in hashes:
                self._lock_cnt[h] = self._lock_cnt.get(h, 0) + 1
        self._evict()

    def unlock(self, req_id: str) -> bool:
        """Release `req_id`'s lock (its blocks stay cached); False when it held none."""
        hashes = self._locks.pop(req_id, None)
        if hashes is None:
            return False
        for h in hashes:
            left = self._lock_cnt[h] - 1
            if left:
                self._lock_cnt[h] = left
            else:
                del self._lock_cnt[h]
        self._evict()
        return True

    def set_capacity(self, capacity_blocks: int) -> None:
        """Follow the worker's pool size (evicting at once if it shrank)."""
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._evict()

    def clear(self) -> None:
        """Forget everything unlocked (the worker restarted or flushed its cache)."""
        for h in [h for h in self._lru if h not in self._lock_cnt]:
            del self._lru[h]

    def _evict(self) -> None:
        excess = len(self._lru) - self.capacity_blocks
        if excess <= 0:
            return
        victims = []
        for h in self._lru:  # least recently used first
            if h not in self._lock_cnt:
                victims.append(h)
                if len(victims) == excess:
                    break
        for h in victims:
            del self._lru[h]
        self.num_evictions += len(victims)
