"""Pair selection: prefix affinity, load balance, conditional disaggregation, decode fit."""

import random
import time

import pytest

from tandem.router.errors import WorkerUnavailable
from tandem.router.policy import (
    DISAGGREGATED,
    LOCAL_PREFILL,
    AdmissionConfig,
    DecodeLatencyModel,
    DecodeObservation,
    GoodputPolicy,
    PairSelector,
    PlacementRequest,
    PrefillLatencyModel,
    SelectorConfig,
    SloConfig,
    WorkerState,
)
from tests.helpers.clock import FakeClock
from tests.helpers.policy_sim import SimRequest, poisson_arrivals, simulate

BS = 16
INTERACTIVE = SloConfig().resolve("interactive")
LAW = PrefillLatencyModel().predict  # true service law of the simulated workers


def cluster(num_prefill: int = 2, num_decode: int = 1, decode_blocks: int = 1 << 20):
    prefill = [
        WorkerState(f"p{i}", "prefill", block_size=BS, num_blocks=1 << 16)
        for i in range(num_prefill)
    ]
    decode = [
        WorkerState(f"d{i}", "decode", block_size=BS, num_blocks=decode_blocks)
        for i in range(num_decode)
    ]
    return prefill, decode


def sim_policy(**selector) -> tuple[GoodputPolicy, FakeClock]:
    clock = FakeClock()
    prefill, decode = cluster()
    policy = GoodputPolicy(
        prefill,
        decode,
        selector_config=SelectorConfig(enable_local_prefill=False, **selector),
        admission_config=AdmissionConfig(policy="none"),
        clock=clock,
    )
    return policy, clock


def unique(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def test_shared_prefixes_stick_to_one_worker():
    """8 prefixes × 16 suffixes: nearly every repeat of a prefix finds it cached."""
    rng = random.Random(0)
    prefix_len = 512
    prefixes = [unique(1_000_000 * (p + 1), prefix_len) for p in range(8)]
    pairs = [(p, s) for p in range(8) for s in range(16)]
    rng.shuffle(pairs)
    times = poisson_arrivals(len(pairs), rate_per_s=60.0, seed=0)
    requests = [
        SimRequest(
            f"r{i}", prefixes[p] + unique(100 * (16 * p + s), rng.randint(32, 64)), t, INTERACTIVE
        )
        for i, ((p, s), t) in enumerate(zip(pairs, times, strict=True))
    ]
    policy, clock = sim_policy()
    results, _ = simulate(policy, clock, requests, {"p0": LAW, "p1": LAW}, block_size=BS)
    ideal = 8 * 15 * prefix_len  # every prefix computed once
    hit = sum(r.cached_tokens for r in results)
    assert hit >= 0.8 * ideal
    # Affinity: each prefix's requests went (almost) all to one worker.
    for p in range(8):
        chosen = [r.worker_id for r, (q, _) in zip(results, pairs, strict=True) if q == p]
        assert max(chosen.count("p0"), chosen.count("p1")) >= 14, p
    # ... and the prefixes were spread over both workers.
    per_worker = [sum(r.worker_id == w for r in results) for w in ("p0", "p1")]
    assert min(per_worker) >= 32
    assert policy.decisions == {DISAGGREGATED: 128}
    assert policy.is_idle()


def test_a_salted_prompt_predicts_hits_only_under_its_salt():
    """The router hashes a salted prompt as the workers do (cache_salt): it predicts no
    hit where the prompt was cached unsalted or under another salt, and a hit under its
    own, so affinity follows what the worker's cache can really serve."""
    policy, _ = sim_policy()
    prompt = unique(7_000, 200)
    placements = []
    for i, salt in enumerate((None, "tenant-a", "tenant-a", "tenant-b", None)):
        placement = policy.place_now(
            PlacementRequest(f"r{i}", prompt, 8, INTERACTIVE, cache_salt=salt)
        )
        placements.append(placement)
        policy.on_finish(f"r{i}")
    cached = [200 - p.num_prefill_tokens for p in placements]
    assert cached == [0, 0, 192, 0, 192]  # 12 full blocks of 16; the last token recomputed
    assert placements[2].prefill_worker_id == placements[1].prefill_worker_id


def test_hot_prefix_is_replicated_not_piled_on_one_worker():
    """90% of requests share one hot prefix: both workers end up serving it."""
    rng = random.Random(1)
    hot = unique(5_000_000, 1024)
    times = poisson_arrivals(200, rate_per_s=80.0, seed=1)
    requests, is_hot = [], []
    for i, t in enumerate(times):
        hot_req = rng.random() < 0.9
        prefix = hot if hot_req else unique(10_000_000 + 1000 * i, 256)
        requests.append(SimRequest(f"r{i}", prefix + unique(100 * i, 48), t, INTERACTIVE))
        is_hot.append(hot_req)
    policy, clock = sim_policy()
    # p0 starts with the hot prefix cached: the tempting worker.
    policy.workers["p0"].prefix.insert(hot)
    results, workers = simulate(
        policy, clock, requests, {"p0": LAW, "p1": LAW}, block_size=BS, warm={"p0": [hot]}
    )
    per_worker = [sum(r.worker_id == w for r in results) for w in ("p0", "p1")]
    assert max(per_worker) / min(per_worker) <= 1.5, per_worker
    busy = [workers[w].busy_s for w in ("p0", "p1")]
    assert max(busy) / min(busy) <= 1.5, busy
    hot_hits = [r.cached_tokens >= 1024 for r, h in zip(results, is_hot, strict=True) if h]
    assert sum(hot_hits) >= 0.95 * len(hot_hits) - 2  # replicated once, then hits
    ttfts = sorted(r.ttft_s for r in results)
    assert ttfts[int(0.99 * len(ttfts))] < 0.5


def test_load_guard_overrides_affinity():
    """A worker holding the prefix but with a long queue loses to an idle one."""
    hot = unique(0, 4096)
    prompt = hot + unique(90_000, 32)

    def select(**config):
        prefill, decode = cluster()
        prefill[0].prefix.insert(hot)
        # 0.2 s of queued work on p0: still cheaper than a 4k-token miss (~0.43 s) ...
        prefill[0].on_send("q", num_prefill_tokens=1900, num_blocks=1, decoding=False, now_s=0)
        assert 0.15 < prefill[0].predicted_queue_s() < 0.3
        selector = PairSelector(prefill, decode, SelectorConfig(**config))
        return selector.select(prompt, 16, INTERACTIVE)

    # ... so pure affinity would queue behind it, the guard does not.
    unguarded = select(affinity_max_wait_ratio=1e9, affinity_min_wait_gap_s=1e9)
    assert unguarded.prefill_worker_id == "p0" and not unguarded.affinity_overridden
    assert unguarded.num_cached_tokens == 4096
    guarded = select()
    assert guarded.prefill_worker_id == "p1" and guarded.affinity_overridden
    assert guarded.num_cached_tokens == 0
    # A small queue is not enough to give up the cache.
    prefill, decode = cluster()
    prefill[0].prefix.insert(hot)
    prefill[0].on_send("q", num_prefill_tokens=200, num_blocks=1, decoding=False, now_s=0)
    placement = PairSelector(prefill, decode).select(prompt, 16, INTERACTIVE)
    assert placement.prefill_worker_id == "p0" and placement.num_cached_tokens == 4096


def test_conditional_disaggregation():
    prefill, decode = cluster()
    selector = PairSelector(prefill, decode)
    short = selector.select(unique(0, 64), 32, INTERACTIVE)
    assert short.decision == LOCAL_PREFILL and short.prefill_worker_id is None
    assert short.decode_worker_id == "d0" and short.predicted_ttft_s > 0
    long = selector.select(unique(0, 4096), 32, INTERACTIVE)
    assert long.decision == DISAGGREGATED and long.prefill_worker_id in ("p0", "p1")
    # Mostly cached on the decode worker (e.g. the previous turn): local again.
    decode[0].prefix.insert(unique(0, 4000))
    cached = selector.select(unique(0, 4000) + unique(50_000, 96), 32, INTERACTIVE)
    assert cached.decision == LOCAL_PREFILL and cached.num_cached_tokens == 4000
    # Disabled: always remote when prefill workers exist.
    off = PairSelector(prefill, decode, SelectorConfig(enable_local_prefill=False))
    assert off.select(unique(0, 64), 32, INTERACTIVE).decision == DISAGGREGATED


def test_local_prefill_respects_running_requests_itl():
    tight = SloConfig().resolve("interactive", itl_s=0.03)

    def select(itl_slo_s):
        prefill, decode = cluster()
        for w in prefill:  # a busy prefill pool makes local prefill tempting
            w.on_send("q", num_prefill_tokens=2000, num_blocks=1, decoding=False, now_s=0)
        for i in range(8):
            decode[0].on_send(
                f"run{i}",
                num_prefill_tokens=0,
                num_blocks=64,
                decoding=True,
                now_s=0,
                itl_slo_s=itl_slo_s,
            )
        return PairSelector(prefill, decode).select(unique(0, 400), 32, tight)

    # Its ~45 ms prefill would stall 8 running requests past their 30 ms ITL target.
    assert select(itl_slo_s=0.03).decision == DISAGGREGATED
    # Running requests without an ITL target: local prefill beats the prefill queue.
    assert select(itl_slo_s=None).decision == LOCAL_PREFILL


def test_busy_prefill_pool_makes_medium_prompts_local():
    prefill, decode = cluster()
    for w in prefill:
        w.on_send("q", num_prefill_tokens=8000, num_blocks=1, decoding=False, now_s=0)
    placement = PairSelector(prefill, decode).select(unique(0, 500), 32, INTERACTIVE)
    assert placement.decision == LOCAL_PREFILL
    assert placement.predicted_ttft_s < prefill[0].predicted_queue_s()


def test_without_prefill_workers_everything_is_local():
    _, decode = cluster(num_prefill=0)
    placement = PairSelector([], decode).select(unique(0, 8000), 32, INTERACTIVE)
    assert placement.decision == LOCAL_PREFILL and placement.prefill_worker_id is None
    prefill, decode = cluster()
    for w in prefill:
        w.available = False
    placement = PairSelector(prefill, decode).select(unique(0, 8000), 32, INTERACTIVE)
    assert placement.decision == LOCAL_PREFILL


def test_with_no_decode_worker_the_503_asks_to_come_back_after_the_restart_hold():
    """Retry-After: 2 s (a replacement's start) while no decode worker serves, plus what
    is left of the decode role's restart backoff when its next start is held back."""
    prefill, decode = cluster()
    decode[0].available = False
    selector = PairSelector(prefill, decode)
    with pytest.raises(WorkerUnavailable) as plain:
        selector.select(unique(0, 50), 8, INTERACTIVE)
    assert plain.value.retry_after_s == 2.0
    assert "dying young" not in str(plain.value)
    selector.decode_start_held_until_unix_s = time.time() + 30.0
    with pytest.raises(WorkerUnavailable) as held:
        selector.select(unique(0, 50), 8, INTERACTIVE)
    assert 31.0 <= held.value.retry_after_s <= 32.0
    assert "new decode workers keep dying young, the next starts in 30 s" in str(held.value)
    selector.decode_start_held_until_unix_s = time.time() - 1.0  # a hold that has passed
    with pytest.raises(WorkerUnavailable) as passed:
        selector.select(unique(0, 50), 8, INTERACTIVE)
    assert passed.value.retry_after_s == 2.0


def test_decode_choice_by_free_blocks_and_step_time():
    prefill, _ = cluster()
    small = WorkerState("d0", "decode", block_size=BS, num_blocks=64)
    big = WorkerState("d1", "decode", block_size=BS, num_blocks=4096)
    selector = PairSelector(prefill, [small, big])
    # 2000 + 200 tokens need 138 blocks: only d1 fits.
    placement = selector.select(unique(0, 2000), 200, INTERACTIVE)
    assert placement.decode_worker_id == "d1" and placement.fits
    assert placement.num_decode_blocks == 138
    # Both fit: the one whose step stays shorter after admission.
    small2 = WorkerState("d0", "decode", block_size=BS, num_blocks=4096)
    for i in range(32):
        small2.on_send(f"x{i}", num_prefill_tokens=0, num_blocks=100, decoding=True, now_s=0)
    placement = PairSelector(prefill, [small2, big]).select(unique(0, 100), 10, INTERACTIVE)
    assert placement.decode_worker_id == "d1"
    assert placement.predicted_itl_s == pytest.approx(big.predicted_step_s(1, 100))
    # Nothing fits now: the emptiest, flagged so admission can hold it back.
    small.on_send("busy", num_prefill_tokens=0, num_blocks=60, decoding=True, now_s=0)
    full = PairSelector(prefill, [small]).select(unique(0, 100), 10, INTERACTIVE)
    assert not full.fits and full.decode_worker_id == "d0"
    small.on_complete("busy", now_s=0)
    small.available = False
    with pytest.raises(WorkerUnavailable, match="no decode worker"):
        PairSelector(prefill, [small]).select(unique(0, 10), 10, INTERACTIVE)


def test_a_decode_worker_seen_slow_once_is_placed_on_again_a_minute_later():
    """Only placed requests teach a worker's model: one seen slow in a contended minute
    and then placed on by nobody (its peer looks faster) would never be placed on again
    (a soak's 1P+2D cluster ran one decode worker at 15 sequences, the other at none)."""
    clock = FakeClock(start=1000.0)
    profile = [DecodeObservation(b, b * 300, 0.008 + 0.0005 * b) for b in (1, 8, 32)]
    busy, starved = (
        WorkerState(name, "decode", block_size=BS, num_blocks=4000,
                    decode_model=DecodeLatencyModel.from_profile(profile, clock=clock))
        for name in ("d0", "d1")
    )  # fmt: skip
    for _ in range(64):  # the contended minute: both see 120 ms gaps
        busy.decode_model.observe(4, 1200, 0.12)
        starved.decode_model.observe(1, 300, 0.12)
    clock.advance(30)
    for _ in range(64):  # quiet again, and only d0 is placed on, so only it learns
        busy.decode_model.observe(4, 1200, 0.012)
    selector = PairSelector([], [busy, starved])

    def place(requests: range) -> list[str]:
        chosen = []
        for i in requests:
            placement = selector.select(unique(i * 1000, 300), 48, INTERACTIVE)
            worker = busy if placement.decode_worker_id == "d0" else starved
            worker.on_send(f"r{i}", num_prefill_tokens=0, num_blocks=22, decoding=True,
                           now_s=clock(), itl_slo_s=INTERACTIVE.itl_s)  # fmt: skip
            chosen.append(placement.decode_worker_id)
        return chosen

    assert place(range(8)) == ["d0"] * 8  # d1 still predicted to miss the ITL target
    clock.advance(31)  # a minute since d1's last observation
    assert "d1" in place(range(8, 16))


def test_a_busy_prefill_pool_does_not_hold_short_prompts_hostage():
    """Running requests with a tight ITL target forbid a local prefill stall — unless the
    prefill pool is so busy (a long document) that disaggregating misses the new
    request's TTFT target while a local prefill answers sooner."""
    prefill, decode = cluster(num_prefill=1)
    prefill[0].on_send("doc", num_prefill_tokens=30_000, num_blocks=1, decoding=False, now_s=0)
    for i in range(8):
        decode[0].on_send(
            f"run{i}", num_prefill_tokens=0, num_blocks=64, decoding=True, now_s=0, itl_slo_s=0.001
        )
    assert prefill[0].predicted_queue_s() > INTERACTIVE.ttft_s
    placement = PairSelector(prefill, decode).select(unique(0, 64), 32, INTERACTIVE)
    assert placement.decision == LOCAL_PREFILL
    assert placement.predicted_ttft_s <= INTERACTIVE.ttft_s
    # Beyond the local prefill limit the guard holds.
    long = PairSelector(prefill, decode).select(unique(0, 600), 32, INTERACTIVE)
    assert long.decision == DISAGGREGATED


def test_colocated_workers_are_chosen_by_their_prefill_queue():
    _, (busy, idle) = cluster(num_prefill=0, num_decode=2)
    busy.on_send("doc", num_prefill_tokens=8000, num_blocks=600, decoding=True, now_s=0)
    placement = PairSelector([], [busy, idle]).select(unique(0, 64), 32, INTERACTIVE)
    assert placement.decode_worker_id == idle.worker_id
    assert placement.predicted_ttft_s < busy.predicted_queue_s()


def test_a_request_needing_more_than_the_whole_pool_fits_once_it_is_all_free():
    """A forked request (n outputs charged) may need more blocks than the decode pool
    has: its sequences take turns by preemption. It fits once the pool is all free;
    before, it never fit, and admission refused it as retriable for ever."""
    prefill, _ = cluster()
    decode = WorkerState("d0", "decode", block_size=BS, num_blocks=16)
    selector = PairSelector(prefill, [decode])
    placement = selector.select(unique(0, 150), 2 * 100, INTERACTIVE)  # 22 blocks
    assert placement.num_decode_blocks == 22 and placement.fits
    decode.on_send("other", num_prefill_tokens=0, num_blocks=1, decoding=True, now_s=0)
    assert not selector.select(unique(0, 150), 2 * 100, INTERACTIVE).fits
