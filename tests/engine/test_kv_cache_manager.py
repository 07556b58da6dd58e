"""Per-request block tables and the prefix cache over the pool."""

from tandem.engine.block_pool import BlockPool
from tandem.engine.kv_cache_manager import KVCacheManager, chain_hash
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams

BLOCK = 4


def make(num_blocks: int = 16) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks), BLOCK, enable_prefix_caching=True)


def request(req_id: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4, cache_salt=cache_salt))


def run_prefill(kv: KVCacheManager, req: Request) -> None:
    cached = kv.find_cached_prefix(req)
    assert kv.allocate_slots(req, req.num_tokens - len(cached) * BLOCK, cached)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)


def test_chain_hash_depends_on_parent():
    assert chain_hash(b"a", [1, 2]) != chain_hash(b"b", [1, 2])
    assert chain_hash(b"a", [1, 2]) == chain_hash(b"a", (1, 2))


def test_allocate_slots_counts_blocks():
    kv = make(4)
    req = request("r", list(range(10)))
    assert kv.allocate_slots(req, 10)
    assert len(kv.block_ids["r"]) == 3
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 2)  # positions 10, 11 fit the third block
    assert len(kv.block_ids["r"]) == 3
    req.num_computed_tokens = 12
    assert kv.allocate_slots(req, 1)
    assert len(kv.block_ids["r"]) == 4
    req.num_computed_tokens = 13
    assert not kv.allocate_slots(req, 4), "the pool is exhausted"
    kv.free(req)
    assert kv.pool.num_free_blocks == 4


def test_prefix_hit_shares_blocks_and_never_covers_last_token():
    kv = make()
    first = request("a", list(range(12)))
    run_prefill(kv, first)
    second = request("b", list(range(12)))
    hits = kv.find_cached_prefix(second)
    # 12 tokens = 3 full blocks, but the last token is recomputed: 2 blocks hit.
    assert hits == kv.block_ids["a"][:2]
    assert kv.allocate_slots(second, 4, hits)
    assert kv.block_ids["b"][:2] == hits
    assert kv.pool.ref_cnt(hits[0]) == 2
    kv.free(first)
    kv.free(second)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_divergent_prefix_stops_the_hit_chain():
    kv = make()
    run_prefill(kv, request("a", list(range(13))))
    other = request("b", [0, 1, 2, 3, 99, 5, 6, 7, 8, 9, 10, 11, 12])
    assert len(kv.find_cached_prefix(other)) == 1


def test_a_cache_salt_shares_prefix_blocks_only_with_the_same_salt():
    """vLLM's cache_salt: a salted prompt's blocks hash from a salted root, so a prompt
    without that salt (or with another) finds none of them, and the same salt finds all."""
    kv = make()
    tokens = list(range(13))
    run_prefill(kv, request("a", tokens, cache_salt="tenant-a"))
    assert kv.find_cached_prefix(request("plain", tokens)) == []
    assert kv.find_cached_prefix(request("b", tokens, cache_salt="tenant-b")) == []
    assert (
        kv.find_cached_prefix(request("a2", tokens, cache_salt="tenant-a"))
        == (kv.block_ids["a"][:3])
    )
    run_prefill(kv, request("p", tokens))  # unsalted prompts share among themselves
    assert len(kv.find_cached_prefix(request("p2", tokens))) == 3


def test_prefix_caching_off_finds_nothing():
    kv = KVCacheManager(BlockPool(8), BLOCK, enable_prefix_caching=False)
    first = request("a", list(range(9)))
    run_prefill(kv, first)
    assert kv.pool.num_cached_blocks == 0
    assert kv.find_cached_prefix(request("b", list(range(9)))) == []
