"""The KV cache size of the tests' engines.

An engine zero-fills its whole KV cache at start (1 GiB by default). On the CI VMs
first-touching a GiB took 0.5 s when quiet and up to 16 s under load (measured while the
suite ran), and the suite starts dozens of engines; the tiny model's 4 KiB of KV per
token needs far less. 64 MiB holds 16,384 tokens (1,024 blocks of 16), ample for every
test's prompts and batches.
"""

from __future__ import annotations

TEST_KV_CACHE_BYTES = 64 << 20
# The same, as the `--kv-cache-memory` flag of `tandem serve` / `tandem demo`.
TEST_KV_CACHE_FLAG = ("--kv-cache-memory", str(TEST_KV_CACHE_BYTES))


def with_test_kv(overrides: dict) -> dict:
    """Engine config overrides with the tests' KV cache size unless they size it."""
    if "num_blocks" in overrides or "kv_cache_memory_bytes" in overrides:
        return overrides
    return {"kv_cache_memory_bytes": TEST_KV_CACHE_BYTES, **overrides}
