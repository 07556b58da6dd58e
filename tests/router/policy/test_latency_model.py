"""Latency models: fit synthetic laws, adapt to a regime shift, stay sane when sparse."""

import math
import random

import pytest

from tandem.router.policy import (
    DecodeLatencyModel,
    DecodeObservation,
    PrefillLatencyModel,
    PrefillObservation,
)


def prefill_law(n: float) -> float:
    return 0.01 + 2e-4 * n + 3e-8 * n * n


def decode_law(batch: float, context: float) -> float:
    return 0.008 + 3e-4 * batch + 2e-7 * context


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def noisy(rng: random.Random, value: float, noise: float = 0.03) -> float:
    return value * rng.uniform(1 - noise, 1 + noise)


def test_prefill_fits_quadratic_law_from_profile():
    rng = random.Random(0)
    sizes = [log_uniform(rng, 16, 8192) for _ in range(60)]
    model = PrefillLatencyModel.from_profile(
        PrefillObservation(n, noisy(rng, prefill_law(n))) for n in sizes
    )
    for n in (16, 128, 1024, 4096, 8192):
        assert model.predict(n) == pytest.approx(prefill_law(n), rel=0.06), n
    a, _b, c = model.coefficients
    assert a == pytest.approx(0.01, rel=0.3) and c == pytest.approx(3e-8, rel=0.3)
    assert model.predict(0) == 0.0


def test_decode_fits_linear_law():
    rng = random.Random(1)
    obs = []
    for _ in range(80):
        batch = rng.randint(1, 64)
        context = batch * rng.randint(100, 4000)
        obs.append(DecodeObservation(batch, context, noisy(rng, decode_law(batch, context))))
    model = DecodeLatencyModel.from_profile(obs)
    for batch, context in ((1, 200), (16, 32_000), (64, 200_000)):
        predicted = model.predict(batch, context)
        assert predicted == pytest.approx(decode_law(batch, context), rel=0.06)


def test_prefill_adapts_after_regime_shift():
    rng = random.Random(2)
    model = PrefillLatencyModel.from_profile(
        PrefillObservation(n, noisy(rng, prefill_law(n)))
        for n in (log_uniform(rng, 16, 8192) for _ in range(60))
    )
    assert model.predict(2048) == pytest.approx(prefill_law(2048), rel=0.06)
    # The worker becomes twice as slow (throttling, a noisy neighbour...).
    for _ in range(150):
        n = log_uniform(rng, 16, 8192)
        model.observe(n, noisy(rng, 2 * prefill_law(n)))
    for n in (64, 1024, 4096):
        assert model.predict(n) == pytest.approx(2 * prefill_law(n), rel=0.1), n
    assert model.num_observations <= 256  # bounded memory


def test_decode_adapts_after_regime_shift():
    rng = random.Random(3)
    model = DecodeLatencyModel()
    for _ in range(100):
        batch = rng.randint(1, 64)
        context = batch * rng.randint(100, 2000)
        model.observe(batch, context, noisy(rng, decode_law(batch, context)))
    before = model.predict(32, 32_000)
    for _ in range(150):
        batch = rng.randint(1, 64)
        context = batch * rng.randint(100, 2000)
        model.observe(batch, context, noisy(rng, 0.5 * decode_law(batch, context)))
    after = model.predict(32, 32_000)
    assert before == pytest.approx(decode_law(32, 32_000), rel=0.06)
    assert after == pytest.approx(0.5 * decode_law(32, 32_000), rel=0.1)


def test_sane_with_few_observations():
    prior = PrefillLatencyModel()
    assert prior.num_observations == 0
    # No data: the prior (positive, increasing).
    values = [prior.predict(n) for n in (1, 64, 1024, 8192)]
    assert all(v > 0 for v in values) and values == sorted(values)
    # One observation 5x slower than the prior: the prior's shape, at the data's level.
    one = PrefillLatencyModel()
    one.observe(1000, 5 * prior.predict(1000))
    for n in (16, 1000, 8192):
        assert one.predict(n) == pytest.approx(5 * prior.predict(n), rel=0.05), n
    # Degenerate data (always the same size) cannot bend the curve downwards.
    same = DecodeLatencyModel()
    for _ in range(20):
        same.observe(8, 4096, 0.02)
    assert same.predict(8, 4096) == pytest.approx(0.02, rel=0.05)
    assert same.predict(1, 100) <= same.predict(8, 4096) <= same.predict(64, 100_000)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_observations_leave_the_window_after_a_minute():
    clock = FakeClock()
    profile = [DecodeObservation(b, b * 300, decode_law(b, b * 300)) for b in (1, 8, 32)]
    model = DecodeLatencyModel.from_profile(profile, clock=clock)
    fresh = model.predict(4, 1200)
    assert fresh == pytest.approx(decode_law(4, 1200), rel=0.05)
    clock.now += 30
    for _ in range(300):  # a contended half-minute, 10x slower (the seeds leave the ring)
        model.observe(4, 1200, 10 * decode_law(4, 1200))
    assert model.predict(4, 1200) == pytest.approx(10 * fresh, rel=0.1)
    clock.now += 59  # 59 s after the slow ones: they still count
    assert model.predict(4, 1200) == pytest.approx(10 * fresh, rel=0.1)
    clock.now += 2  # nobody observed it for over a minute: its prior (the profile) again
    assert model.predict(4, 1200) == pytest.approx(fresh, rel=0.05)
    model.observe(4, 1200, 2 * fresh)  # and it learns from new observations at once
    assert model.predict(4, 1200) == pytest.approx(2 * fresh, rel=0.05)


def test_nonsense_data_keeps_predictions_non_negative_and_monotone():
    model = PrefillLatencyModel()
    for n in range(16, 4096, 64):
        model.observe(n, max(0.0, 0.5 - n * 1e-4))  # longer prompts "faster"
    values = [model.predict(n) for n in (16, 256, 1024, 4096)]
    assert all(v >= 0 for v in values) and values == sorted(values)
    assert all(c >= 0 for c in model.coefficients)


def test_queue_prediction_sums_requests():
    model = PrefillLatencyModel(coefficients=(0.01, 1e-4, 0.0))
    assert model.predict_queue(0, 0) == 0.0
    assert model.predict_queue(2000, 4) == pytest.approx(4 * 0.01 + 2000 * 1e-4)


def test_validation():
    with pytest.raises(ValueError, match="seconds"):
        PrefillLatencyModel().observe(10, -1.0)
    with pytest.raises(ValueError, match="window"):
        PrefillLatencyModel(window=0)
    with pytest.raises(ValueError, match="half_life"):
        DecodeLatencyModel(half_life=0)
