"""The router's start-up profile: what it asks of a real decode worker, and what it
learns from it."""

from __future__ import annotations

from tandem.router.warmup_profile import (
    PROBE_BATCH_PROMPT_LEN,
    PROBE_BATCH_SIZES,
    PROBE_DECODE_TOKENS,
    PROBE_PROMPT_LENS,
    probe_batch_sizes,
    probe_decode,
)
from tandem.worker.config import WorkerRole


def test_batch_probes_fit_what_the_worker_runs_and_holds():
    assert probe_batch_sizes(64, 10_000, 16, 1024) == list(PROBE_BATCH_SIZES)
    # At most max_num_seqs sequences a step ...
    assert probe_batch_sizes(12, 10_000, 16, 1024) == [8, 12]
    # ... and as many as the KV blocks hold (a probe takes 2 blocks of 16 tokens).
    assert probe_batch_sizes(64, 10, 16, 1024) == [5]
    # A worker too old to report max_num_seqs, or one sequence a step: batch 1 only.
    assert probe_batch_sizes(0, 10_000, 16, 1024) == []
    assert probe_batch_sizes(1, 10_000, 16, 1024) == []
    assert probe_batch_sizes(64, 10_000, 16, 8) == []


def test_the_decode_profile_times_steps_of_several_sequences(cluster):
    """Batch 1 alone cannot tell what a step costs per sequence (the planner then took a
    batch of 64 for the price of one); the profile also times batches, on the worker's
    own terms, and leaves it idle (the fixture checks)."""
    router = cluster.router
    worker = next(w for w in router.pool.workers if w.role is WorkerRole.DECODE)
    stats = cluster.run(router.pool.worker_stats(worker, 10.0))
    assert stats.max_num_seqs == 64  # the engine's default, reported in Stats
    probe = probe_decode(router.pool, worker, vocab_size=2048, max_len=stats.max_model_len,
                         timeout_s=60.0, batch_sizes=[4, 8])  # fmt: skip
    prefill_obs, decode_obs = cluster.run(probe)
    assert [o.num_tokens for o in prefill_obs] == list(PROBE_PROMPT_LENS)
    batches = [o.batch_size for o in decode_obs]
    assert set(batches[:-2]) == {1} and batches[-2:] == [4, 8]
    context = PROBE_BATCH_PROMPT_LEN + PROBE_DECODE_TOKENS // 2
    assert [o.num_context_tokens for o in decode_obs[-2:]] == [4 * context, 8 * context]
    assert all(o.seconds > 0 for o in decode_obs)
