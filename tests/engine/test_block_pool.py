"""Block pool: reference counts, LRU eviction of cached blocks, no double frees."""

import pytest

from tandem.engine.block_pool import BlockPool


def test_allocate_and_free_return_to_idle():
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert blocks is not None and len(set(blocks)) == 5
    assert pool.num_free_blocks == 3
    assert pool.allocate(4) is None
    assert pool.num_free_blocks == 3, "a failed allocation must change nothing"
    pool.free(blocks)
    assert pool.num_free_blocks == 8


def test_shared_block_is_freed_only_by_last_reference():
    pool = BlockPool(4)
    [block] = pool.allocate(1)
    pool.share([block])
    assert pool.ref_cnt(block) == 2
    pool.free([block])
    assert pool.num_free_blocks == 3
    pool.free([block])
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([block])


def test_cached_block_survives_free_until_evicted_lru_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"ha", (1, 2))
    pool.cache(b, b"hb", (3, 4))
    pool.free([a])
    pool.free([b])
    pool.free([c])
    assert pool.lookup(b"ha", (1, 2)) == a
    # A hit on a free block takes it off the free list.
    pool.share([a])
    assert pool.num_free_blocks == 2
    pool.free([a])
    # LRU order is now b, c, a: the first allocation evicts b's cached prefix.
    [first] = pool.allocate(1)
    assert first == b
    assert pool.lookup(b"hb", (3, 4)) is None
    assert pool.lookup(b"ha", (1, 2)) == a
    assert pool.num_evictions == 1


def test_lookup_checks_tokens_not_just_hash():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.cache(block, b"h", (1, 2, 3))
    assert pool.lookup(b"h", (1, 2, 3)) == block
    assert pool.lookup(b"h", (1, 2, 4)) is None


def test_invalid_size_is_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
