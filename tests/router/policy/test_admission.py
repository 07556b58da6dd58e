"""Admission: shedding keeps admitted requests within SLO; priorities; the queue."""

import asyncio
import random

import pytest

from tandem.router.errors import Overloaded
from tandem.router.policy import (
    AdmissionConfig,
    AdmissionController,
    GoodputPolicy,
    Placement,
    PlacementRequest,
    PrefillLatencyModel,
    SelectorConfig,
    SloConfig,
    WorkerState,
)
from tests.helpers.clock import FakeClock
from tests.helpers.policy_sim import SimRequest, poisson_arrivals, simulate
from tests.helpers.waiting import wait_until

BS = 16
SLOS = SloConfig()
INTERACTIVE = SLOS.resolve("interactive")
BATCH = SLOS.resolve("batch")


def make_policy(
    policy: str, *, decode_blocks: int = 1 << 20, clock=None, **admission
) -> GoodputPolicy:
    prefill = [WorkerState("p0", "prefill", block_size=BS, num_blocks=1 << 16)]
    decode = [WorkerState("d0", "decode", block_size=BS, num_blocks=decode_blocks)]
    kwargs = {"clock": clock} if clock is not None else {}
    return GoodputPolicy(
        prefill,
        decode,
        selector_config=SelectorConfig(enable_local_prefill=False),
        admission_config=AdmissionConfig(policy=policy, **admission),
        **kwargs,
    )


def overload_run(policy_name: str) -> tuple[float, float]:
    """2x overload of one prefill worker, 300 ms TTFT target: (attainment, admitted share)."""
    rng = random.Random(7)
    slo = SLOS.resolve("interactive", ttft_s=0.3)
    # The workers are 1.5x slower than the policy's prior: it must learn that online.
    prior = PrefillLatencyModel()
    law = lambda n: 1.5 * prior.predict(n)  # noqa: E731
    mean_service = sum(law(n) for n in range(128, 1025)) / 897
    rate = 2.0 / mean_service
    times = poisson_arrivals(300, rate, seed=7)
    requests = [
        SimRequest(f"r{i}", list(range(10_000 * i, 10_000 * i + rng.randint(128, 1024))), t, slo)
        for i, t in enumerate(times)
    ]
    clock = FakeClock()
    policy = make_policy(policy_name, clock=clock)
    results, _ = simulate(policy, clock, requests, {"p0": law}, block_size=BS, noise=0.1, seed=7)
    admitted = [r for r in results if r.placement is not None]
    met = [r for r in admitted if slo.slo.attained(r.ttft_s)]
    assert policy.is_idle()
    return len(met) / len(admitted), len(admitted) / len(results)


def test_shedding_keeps_slo_attainment_under_overload():
    attainment_none, admitted_none = overload_run("none")
    attainment_shed, admitted_shed = overload_run("shed")
    assert admitted_none == 1.0
    assert attainment_none < 0.5
    assert attainment_shed >= 0.9
    # It sheds the excess, not everything (capacity is about half the offered load).
    assert admitted_shed >= 0.35


def placement(**overrides) -> Placement:
    fields = dict(
        prefill_worker_id="p0",
        decode_worker_id="d0",
        decision="disaggregated",
        predicted_queue_s=0.0,
        predicted_ttft_s=0.2,
        predicted_itl_s=0.02,
        num_prompt_tokens=100,
        num_cached_tokens=0,
        num_decode_blocks=10,
        fits=True,
    )
    fields.update(overrides)
    return Placement(**fields)


def test_evaluate_rules():
    shed = AdmissionController(AdmissionConfig(policy="shed", best_effort_max_wait_s=0.1))
    assert shed.evaluate(placement(), INTERACTIVE).admit
    late = shed.evaluate(placement(predicted_queue_s=3.9, predicted_ttft_s=4.0), INTERACTIVE)
    assert not late.admit and late.reason == "ttft"
    assert late.retry_after_s == pytest.approx(3.0)
    # A prompt whose own prefill misses the target with no queue (no wait helps it) is
    # served as best effort: into idle capacity, else refused until the queue drains.
    assert shed.evaluate(placement(predicted_ttft_s=4.0), INTERACTIVE).admit
    long_busy = shed.evaluate(placement(predicted_queue_s=2.1, predicted_ttft_s=6.0), INTERACTIVE)
    assert not long_busy.admit and long_busy.reason == "ttft_out_of_reach"
    assert long_busy.retry_after_s == pytest.approx(2.0)
    assert shed.evaluate(placement(predicted_itl_s=1.0), INTERACTIVE).reason == "itl"
    assert shed.evaluate(placement(fits=False), INTERACTIVE).reason == "kv_blocks"
    assert shed.evaluate(placement(), INTERACTIVE, outranked=True).reason == "priority"
    # Best effort: no target, but only idle capacity.
    assert shed.evaluate(placement(predicted_ttft_s=50.0), BATCH).admit
    busy = shed.evaluate(placement(predicted_queue_s=0.5), BATCH)
    assert not busy.admit and busy.reason == "idle_capacity"
    # Retry-After is bounded.
    far = placement(predicted_queue_s=1e6 - 0.1, predicted_ttft_s=1e6)
    assert shed.evaluate(far, INTERACTIVE).retry_after_s == 30.0
    none = AdmissionController(AdmissionConfig(policy="none"))
    assert none.evaluate(placement(predicted_ttft_s=1e6, fits=False), INTERACTIVE).admit
    with pytest.raises(ValueError, match="policy"):
        AdmissionConfig(policy="maybe")
    with pytest.raises(ValueError, match="queue_timeout_s"):
        AdmissionConfig(queue_timeout_s=0)


def test_batch_fills_idle_capacity_only_and_is_shed_first():
    policy = make_policy("shed")
    b0 = policy.place_now(PlacementRequest("b0", list(range(500)), 16, BATCH))
    assert b0.decision  # idle: admitted
    policy.on_finish("b0")
    # Interactive traffic builds a queue on the only prefill worker ...
    for i in range(4):
        policy.place_now(
            PlacementRequest(
                f"i{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 800)), 16, INTERACTIVE
            )
        )
    assert policy.workers["p0"].predicted_queue_s() > 0.1
    # ... so batch work is refused (Retry-After set) while interactive still gets in.
    with pytest.raises(Overloaded) as info:
        policy.place_now(PlacementRequest("b1", list(range(90_000, 90_500)), 16, BATCH))
    assert info.value.retry_after_s >= 0.5
    assert policy.place_now(PlacementRequest("i9", list(range(80_000, 80_100)), 16, INTERACTIVE))
    assert policy.rejections["idle_capacity"] == 1


def test_queue_admits_when_capacity_frees():
    async def main():
        # 64 decode blocks: one 40-block request at a time.
        policy = make_policy("queue", decode_blocks=64, queue_timeout_s=2.0)
        first = await policy.place(PlacementRequest("a", list(range(600)), 40, INTERACTIVE))
        assert first.fits
        waiting = asyncio.ensure_future(
            policy.place(PlacementRequest("b", list(range(1000, 1600)), 40, INTERACTIVE))
        )
        await wait_until(lambda: len(policy.queue) == 1, what="b queued")
        assert not waiting.done()
        policy.on_finish("a")
        second = await asyncio.wait_for(waiting, 1.0)
        assert second.fits and policy.placement_of("b") == second
        policy.on_finish("b")
        assert policy.is_idle()

    asyncio.run(main())


def test_queue_times_out_with_retry_after():
    async def main():
        clock = FakeClock()
        policy = make_policy(
            "queue", decode_blocks=64, clock=clock, queue_timeout_s=30.0, recheck_interval_s=0.01
        )
        await policy.place(PlacementRequest("a", list(range(600)), 40, INTERACTIVE))
        waiting = asyncio.ensure_future(
            policy.place(PlacementRequest("b", list(range(1000, 1600)), 40, INTERACTIVE))
        )
        await wait_until(lambda: len(policy.queue) == 1, what="b queued")
        # Just before the deadline (by the policy's clock) it still waits, rechecking ...
        clock.advance(29.9)
        await asyncio.wait({waiting}, timeout=0.05)
        assert not waiting.done()
        # ... and once the clock passes it, the next recheck gives up.
        clock.advance(0.2)
        with pytest.raises(Overloaded) as info:
            await asyncio.wait_for(waiting, 5.0)
        assert info.value.retry_after_s > 0
        assert policy.queue.num_timeouts == 1 and len(policy.queue) == 0
        policy.on_finish("a")
        assert policy.is_idle()

    asyncio.run(main())


def test_queue_priority_order_and_displacement():
    async def main():
        policy = make_policy("queue", decode_blocks=64, max_queue_len=2, queue_timeout_s=2.0)
        await policy.place(PlacementRequest("a", list(range(600)), 40, INTERACTIVE))
        order = []

        async def place(req_id, slo):
            base = 1000 * (len(order) + 1) + 100_000 * int(req_id[-1])
            p = await policy.place(PlacementRequest(req_id, list(range(base, base + 600)), 40, slo))
            order.append(req_id)
            return p

        batch1 = asyncio.ensure_future(place("batch1", BATCH))
        await wait_until(lambda: len(policy.queue) == 1, what="batch1 queued")
        inter1 = asyncio.ensure_future(place("inter1", INTERACTIVE))
        await wait_until(lambda: len(policy.queue) == 2, what="inter1 queued")
        # Full (2): a newcomer interactive request displaces the batch one ...
        inter2 = asyncio.ensure_future(place("inter2", INTERACTIVE))
        with pytest.raises(Overloaded, match="displaced"):
            await asyncio.wait_for(batch1, 5.0)
        # ... but a batch request cannot displace interactive ones.
        with pytest.raises(Overloaded, match="full"):
            await policy.place(PlacementRequest("batch2", list(range(700_000, 700_600)), 40, BATCH))
        # Capacity frees one request at a time: interactive ones in arrival order.
        policy.on_finish("a")
        await asyncio.wait_for(inter1, 1.0)
        assert order == ["inter1"] and not inter2.done()
        policy.on_finish("inter1")
        await asyncio.wait_for(inter2, 1.0)
        policy.on_finish("inter2")
        assert order == ["inter1", "inter2"] and policy.queue.num_displaced == 1
        assert policy.is_idle()

    asyncio.run(main())


def test_cancelled_waiter_leaves_nothing_behind():
    async def main():
        policy = make_policy("queue", decode_blocks=64, queue_timeout_s=2.0)
        await policy.place(PlacementRequest("a", list(range(600)), 40, INTERACTIVE))
        waiting = asyncio.ensure_future(
            policy.place(PlacementRequest("b", list(range(1000, 1600)), 40, INTERACTIVE))
        )
        await wait_until(lambda: len(policy.queue) == 1, what="b queued")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert len(policy.queue) == 0
        policy.on_finish("a")
        assert policy.is_idle()

    asyncio.run(main())


def test_ttft_padding_learns_the_prediction_error():
    from tandem.router.policy.admission import AdmissionConfig, AdmissionController

    clock = FakeClock()
    controller = AdmissionController(
        AdmissionConfig(policy="shed", ttft_error_window=10, ttft_error_horizon_s=5.0),
        clock=clock,
    )
    assert controller.ttft_padding_s == 0.0
    for error in (0.05, 0.1, -0.2, 0.3, 0.0, 0.2, 0.1, 0.05, 0.4, 0.1):
        controller.observe_ttft_error(error)
    # 90th percentile of the ten errors above (nearest rank from below).
    assert controller.ttft_padding_s == 0.4
    clock.advance(6.0)  # nothing admitted (so observed) for longer than the horizon
    assert controller.ttft_padding_s == 0.0
    for _ in range(10):
        controller.observe_ttft_error(0.3)
    assert controller.ttft_padding_s == 0.3
    for _ in range(10):
        controller.observe_ttft_error(-0.5)  # predictions now pessimistic: no padding
    assert controller.ttft_padding_s == 0.0
