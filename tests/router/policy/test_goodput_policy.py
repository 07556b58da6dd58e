"""The facade RequestFlow drives: commit, progress hooks, learning, no leaks."""

import pytest

from tandem.router.errors import Overloaded, WorkerUnavailable
from tandem.router.policy import (
    DISAGGREGATED,
    LOCAL_PREFILL,
    AdmissionConfig,
    AdmissionPolicy,
    GoodputPolicy,
    PlacementRequest,
    SelectorConfig,
    SloConfig,
    WorkerState,
    WorkerStats,
)

BS = 16
INTERACTIVE = SloConfig().resolve("interactive")


def make() -> GoodputPolicy:
    prefill = [WorkerState(f"p{i}", "prefill", block_size=BS, num_blocks=4096) for i in range(2)]
    decode = [WorkerState("d0", "decode", block_size=BS, num_blocks=4096)]
    return GoodputPolicy(prefill, decode)


def test_disaggregated_lifecycle():
    policy = make()
    prompt = list(range(2000))
    placement = policy.place_now(PlacementRequest("r1", prompt, 64, INTERACTIVE))
    assert placement.decision == DISAGGREGATED
    prefill = policy.workers[placement.prefill_worker_id]
    decode = policy.workers["d0"]
    assert prefill.num_queued_prefill_tokens == 2000
    assert prefill.prefix.num_locked_requests == 1 and decode.num_running == 1
    assert decode.num_free_blocks == 4096 - placement.num_decode_blocks
    observed = prefill.prefill_model.num_observations
    policy.on_prefill_done("r1", num_cached_tokens=0, compute_s=0.4)
    policy.on_prefill_done("r1", num_cached_tokens=0, compute_s=0.4)  # idempotent
    assert prefill.prefill_model.num_observations == observed + 1
    assert prefill.num_queued_prefill_tokens == 0 and not prefill.is_idle()  # KV held
    policy.on_kv_pulled("r1")
    assert prefill.is_idle() and decode.num_running == 1
    before = decode.decode_model.num_observations
    policy.observe_itl("r1", 0.03)
    assert decode.decode_model.num_observations == before + 1
    output = list(range(50_000, 50_064))
    policy.on_finish("r1", output)
    policy.on_finish("r1", output)  # idempotent
    assert policy.is_idle()
    # The follow-up turn finds prompt + answer cached where the request decoded.
    follow_up = prompt + output + list(range(70_000, 70_040))
    assert decode.prefix.match_len(follow_up) == (2000 + 64) // BS * BS
    assert prefill.prefix.match_len(follow_up) == 2000 // BS * BS
    assert policy.decisions[DISAGGREGATED] == 1


def test_local_prefill_lifecycle_and_abort_before_first_token():
    policy = make()
    placement = policy.place_now(PlacementRequest("r1", list(range(40)), 16, INTERACTIVE))
    assert placement.decision == LOCAL_PREFILL
    decode = policy.workers["d0"]
    assert decode.num_queued_prefill_tokens == 40
    policy.on_kv_pulled("r1")  # first Decode message: for local prefill, the prompt is done
    assert decode.num_queued_prefill_tokens == 0 and decode.num_running == 1
    policy.on_finish("r1")
    # Abort while still queued for prefill: everything is released.
    policy.place_now(PlacementRequest("r2", list(range(3000)), 16, INTERACTIVE))
    policy.on_finish("r2")
    assert policy.is_idle()
    assert policy.decisions == {LOCAL_PREFILL: 1, DISAGGREGATED: 1}


def test_stats_and_availability_feed_placement():
    policy = make()
    policy.update_stats(
        "p0",
        WorkerStats(
            num_waiting=5, num_blocks=4096, num_free_blocks=4096, num_queued_prefill_tokens=4000
        ),
        taken_at_s=policy.clock(),
    )
    r1 = policy.place_now(PlacementRequest("r1", list(range(3000)), 16, INTERACTIVE))
    assert r1.prefill_worker_id == "p1"
    policy.set_available("p1", False)
    r2 = policy.place_now(PlacementRequest("r2", list(range(9000, 12000)), 16, INTERACTIVE))
    assert r2.prefill_worker_id == "p0"
    with pytest.raises(ValueError, match="already placed"):
        policy.place_now(PlacementRequest("r1", [1, 2, 3], 16, INTERACTIVE))
    policy.on_finish("r1")
    policy.on_finish("r2")
    assert policy.is_idle()


def test_prefix_prediction_accuracy_counters():
    policy = make()
    prompt = list(range(1000))
    policy.place_now(PlacementRequest("a", prompt, 16, INTERACTIVE))
    policy.on_prefill_done("a", num_cached_tokens=0, compute_s=0.1)
    policy.on_finish("a")
    p = policy.place_now(PlacementRequest("b", [*prompt, 1], 16, INTERACTIVE))
    assert p.num_cached_tokens == 992
    policy.on_prefill_done("b", num_cached_tokens=992, compute_s=0.01)
    policy.on_finish("b")
    assert policy.num_predicted_cached_tokens == policy.num_reported_cached_tokens == 992


def test_membership_add_and_remove_while_requests_run():
    """A worker that leaves keeps its requests' accounting until they end (then it is
    forgotten); a worker that joins takes new placements at once."""
    policy = make()
    # Local prefill on d0.
    policy.place_now(PlacementRequest("r1", list(range(40)), 16, INTERACTIVE))
    policy.remove_worker("d0")
    assert "d0" in policy.workers and not policy.workers["d0"].available
    with pytest.raises(WorkerUnavailable) as refused:
        policy.place_now(PlacementRequest("r2", list(range(40)), 16, INTERACTIVE))
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s >= 1
    policy.add_worker(WorkerState("d1", "decode", block_size=BS, num_blocks=4096))
    r2 = policy.place_now(PlacementRequest("r2", list(range(40)), 16, INTERACTIVE))
    assert r2.decode_worker_id == "d1"
    policy.on_finish("r1")
    assert "d0" not in policy.workers
    policy.on_finish("r2")
    assert policy.is_idle()
    with pytest.raises(ValueError, match="block size"):
        policy.add_worker(WorkerState("d2", "decode", block_size=BS * 2, num_blocks=4096))


def test_prefill_worker_that_leaves_after_the_pull_is_forgotten_without_error():
    """A prefill worker removed while its request runs is forgotten once the decode side
    pulled the KV (it holds nothing more); the request's later hooks must not look it up
    again (that was `KeyError: 'p0'` out of the router when a prefill worker left)."""
    policy = make()
    placement = policy.place_now(PlacementRequest("r1", list(range(2000)), 64, INTERACTIVE))
    prefill_id = placement.prefill_worker_id
    assert placement.decision == DISAGGREGATED and prefill_id is not None
    policy.remove_worker(prefill_id)
    assert prefill_id in policy.workers  # still charged with r1's prefill
    policy.on_prefill_done("r1", num_cached_tokens=0, compute_s=0.4)
    policy.on_kv_pulled("r1")
    assert prefill_id not in policy.workers
    policy.on_prefill_done("r1")
    policy.observe_itl("r1", 0.03)
    policy.on_finish("r1", list(range(50_000, 50_064)))
    assert policy.is_idle()


def test_migrated_placement_skips_admission():
    """A request that already streamed tokens is placed again even when admission would
    shed a new one (it was admitted once)."""
    prefill = [WorkerState("p0", "prefill", block_size=BS, num_blocks=4096)]
    decode = [WorkerState("d0", "decode", block_size=BS, num_blocks=4096)]
    policy = GoodputPolicy(
        prefill,
        decode,
        selector_config=SelectorConfig(enable_local_prefill=False),
        admission_config=AdmissionConfig(policy=AdmissionPolicy.SHED),
    )
    tight = SloConfig().resolve("interactive", ttft_s=1e-9)
    # A long prompt ahead of it: the prefill worker is busy (an idle one takes a request
    # whose target is out of reach as best effort).
    relaxed = SloConfig().resolve("interactive", ttft_s=1e9)
    policy.place_now(PlacementRequest("busy", list(range(10_000, 14_000)), 16, relaxed))
    with pytest.raises(Overloaded):
        policy.place_now(PlacementRequest("new", list(range(300)), 16, tight))
    placement = policy.place_migrated(PlacementRequest("old", list(range(300)), 16, tight))
    assert placement.decode_worker_id == "d0"
    with pytest.raises(ValueError, match="still placed"):
        policy.place_migrated(PlacementRequest("old", list(range(300)), 16, tight))
    policy.on_finish("old")
    policy.on_finish("busy")
    assert policy.is_idle()
