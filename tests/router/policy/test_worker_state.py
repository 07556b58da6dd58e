"""The live worker view: snapshot + router-side deltas, counted exactly once."""

from types import SimpleNamespace

import pytest

from tandem.router.policy import WorkerState, WorkerStats


def prefill_worker() -> WorkerState:
    return WorkerState("p0", "prefill", block_size=16, num_blocks=100)


def decode_worker() -> WorkerState:
    return WorkerState("d0", "decode", block_size=16, num_blocks=100)


def test_router_side_accounting_without_snapshots():
    w = prefill_worker()
    w.on_send("a", num_prefill_tokens=500, num_blocks=32, decoding=False, now_s=1.0)
    w.on_send("b", num_prefill_tokens=300, num_blocks=20, decoding=False, now_s=1.1)
    assert w.num_queued_prefill_tokens == 800 and w.num_queued_prefills == 2
    assert w.num_free_blocks == 48
    assert w.predicted_queue_s() > 0
    assert w.on_prefill_done("a", now_s=1.2) and not w.on_prefill_done("a", now_s=1.2)
    assert w.num_queued_prefill_tokens == 300 and w.num_free_blocks == 48  # still held
    w.on_complete("a", now_s=1.3)
    w.on_complete("b", now_s=1.3)  # aborted before its prefill: queue and blocks go
    assert w.num_queued_prefill_tokens == 0 and w.num_free_blocks == 100
    assert w.predicted_queue_s() == 0.0
    assert w.is_idle() and not w.on_complete("a", now_s=2.0)


def test_snapshot_absorbs_earlier_changes_and_later_ones_replay():
    w = prefill_worker()
    w.on_send("a", num_prefill_tokens=500, num_blocks=32, decoding=False, now_s=1.0)
    # The worker saw "a" when it answered the poll sent at t=2.
    w.update_stats(
        WorkerStats(
            num_waiting=1, num_free_blocks=68, num_blocks=100, num_queued_prefill_tokens=500
        ),
        taken_at_s=2.0,
    )
    assert w.num_queued_prefill_tokens == 500 and w.num_free_blocks == 68  # not doubled
    w.on_send("b", num_prefill_tokens=100, num_blocks=7, decoding=False, now_s=3.0)
    assert w.num_queued_prefill_tokens == 600 and w.num_queued_prefills == 2
    w.on_prefill_done("a", now_s=3.5)
    w.on_complete("a", now_s=3.6)
    assert w.num_queued_prefill_tokens == 100 and w.num_free_blocks == 93
    # A late answer to an older poll is ignored.
    w.update_stats(WorkerStats(num_blocks=100, num_free_blocks=0), taken_at_s=1.5)
    assert w.num_free_blocks == 93
    # A fresh snapshot after everything: only it counts.
    w.on_complete("b", now_s=4.0)
    w.update_stats(WorkerStats(num_blocks=100, num_free_blocks=100), taken_at_s=5.0)
    assert w.num_queued_prefill_tokens == 0 and w.num_free_blocks == 100


def test_event_log_is_bounded():
    w = WorkerState("p0", "prefill", block_size=16, num_blocks=10_000, max_events=8)
    for i in range(20):
        w.on_send(f"r{i}", num_prefill_tokens=10, num_blocks=1, decoding=False, now_s=float(i))
    assert len(w._events) <= 8
    assert w.num_queued_prefill_tokens == 200  # folded events still count
    w.update_stats(WorkerStats(num_blocks=10_000, num_free_blocks=10_000), taken_at_s=100.0)
    assert w.num_queued_prefill_tokens == 0


def test_decode_batch_context_and_itl_targets():
    w = decode_worker()
    assert w.num_running == 0 and w.min_itl_slo_s is None
    idle_step = w.predicted_step_s(1, 100)
    w.on_send("a", num_prefill_tokens=0, num_blocks=40, decoding=True, now_s=0, itl_slo_s=0.1)
    w.on_send("b", num_prefill_tokens=0, num_blocks=40, decoding=True, now_s=0, itl_slo_s=0.05)
    assert w.num_running == 2 and w.num_context_tokens == 80 * 16
    assert w.min_itl_slo_s == 0.05
    assert w.predicted_step_s(1, 100) > idle_step
    w.on_complete("b", now_s=1)
    assert w.min_itl_slo_s == 0.1 and w.num_running == 1


def test_stats_from_proto_like_message_and_capacity():
    msg = SimpleNamespace(
        num_waiting=2,
        num_running=3,
        num_free_blocks=10,
        num_blocks=50,
        num_queued_prefill_tokens=77,
        prefix_cache_queries=5,
        prefix_cache_hits=4,
        num_held=9,  # ignored
    )
    stats = WorkerStats.from_proto(msg)
    assert stats.num_blocks == 50 and stats.num_queued_prefill_tokens == 77
    w = decode_worker()
    w.update_stats(stats, taken_at_s=0.0)
    assert w.prefix.capacity_blocks == 50
    assert w.num_running == 3 and w.num_free_blocks == 10


def test_validation():
    with pytest.raises(ValueError, match="role"):
        WorkerState("x", "router", block_size=16, num_blocks=10)
    w = decode_worker()
    w.on_send("a", num_prefill_tokens=0, num_blocks=1, decoding=True, now_s=0)
    with pytest.raises(ValueError, match="already in flight"):
        w.on_send("a", num_prefill_tokens=0, num_blocks=1, decoding=True, now_s=0)
