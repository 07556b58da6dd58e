"""The router's approximate prefix index: engine-equal hashes, matches, LRU, locks."""

import pytest

from tandem.engine.block_pool import BlockPool
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.router.policy import PrefixIndex, block_hashes

BS = 4


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_hashes_and_matches_equal_the_engine():
    """Same prompts through the engine's KV manager and the index: same hits."""
    kv = KVCacheManager(BlockPool(64), BS, enable_prefix_caching=True)
    index = PrefixIndex(BS, capacity_blocks=64)
    shared = tokens(1000, 10)
    prompts = [shared + tokens(0, 7), shared + tokens(50, 3), tokens(7, 9), shared[:8]]
    for i, prompt in enumerate(prompts):
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=1))
        hits = kv.find_cached_prefix(req)
        assert index.match_len(prompt) == len(hits) * BS, i
        assert block_hashes(prompt, BS) == req.block_hashes[: len(prompt) // BS]
        assert kv.allocate_slots(req, req.num_tokens - len(hits) * BS, hits)
        req.num_computed_tokens = req.num_tokens
        kv.cache_full_blocks(req)
        index.insert(prompt)
        kv.free(req)


def test_match_len():
    index = PrefixIndex(BS, capacity_blocks=100)
    prompt = tokens(0, 20)
    assert index.match_len(prompt) == 0
    index.insert(prompt)
    assert index.match_len([*prompt, 99]) == 20
    # The last prompt token is always recomputed, as in the engine.
    assert index.match_len(prompt) == 16
    # Divergence inside block 2: blocks 0 and 1 still match.
    diverged = [*prompt[:9], 7777, *prompt[10:]]
    assert index.match_len(diverged) == 8
    # A different first block matches nothing (hashes are chained).
    assert index.match_len([5555, *prompt[1:]]) == 0
    assert len(index) == 5


def test_lru_evicts_leaves_first_and_stays_prefix_closed():
    index = PrefixIndex(BS, capacity_blocks=6)
    system = tokens(0, 8)  # 2 blocks shared by everyone
    a, b, c = system + tokens(100, 8), system + tokens(200, 8), system + tokens(300, 8)
    index.insert(a)
    index.insert(b)
    assert len(index) == 6
    index.insert(c)  # 2 new blocks: a's tail goes (least recently used), the root stays
    assert len(index) == 6 and index.num_evictions == 2
    assert index.match_len([*a, 0]) == 8
    assert index.match_len([*b, 0]) == 16 and index.match_len([*c, 0]) == 16
    index.insert(a)  # touching a again makes b the oldest
    assert index.match_len([*b, 0]) == 8
    assert index.match_len([*a, 0]) == 16


def test_locked_blocks_are_not_evicted_until_unlocked():
    index = PrefixIndex(BS, capacity_blocks=4)
    a, b = tokens(0, 16), tokens(100, 16)
    index.insert(a, req_id="ra")
    index.insert(b)  # over capacity, but a is locked: b's own blocks go first
    assert index.match_len([*a, 0]) == 16
    assert index.match_len([*b, 0]) == 0
    index.insert(b, req_id="rb")  # both locked: over capacity until unlock
    assert len(index) == 8 and index.num_locked_blocks == 8
    assert index.unlock("ra") and not index.unlock("ra")
    assert len(index) == 4
    assert index.match_len([*a, 0]) == 0 and index.match_len([*b, 0]) == 16
    with pytest.raises(ValueError, match="already holds"):
        index.insert(b, req_id="rb")
    index.unlock("rb")
    assert index.num_locked_requests == 0 and index.num_locked_blocks == 0


def test_shared_blocks_lock_counts_and_capacity_changes():
    index = PrefixIndex(BS, capacity_blocks=100)
    a = tokens(0, 12)
    index.insert(a, req_id="r1")
    index.insert(a, req_id="r2")
    index.unlock("r1")
    index.set_capacity(0)  # still locked by r2
    assert index.match_len([*a, 0]) == 12
    index.unlock("r2")
    assert len(index) == 0
    index.set_capacity(10)
    index.insert(a)
    index.clear()
    assert len(index) == 0
