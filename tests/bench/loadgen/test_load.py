"""Load drivers: the Poisson schedule's statistics (no clock involved) and the drivers'
bookkeeping against a fake client (counts, concurrency, injections, the run timeout)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from tandem.bench.loadgen.load import (
    RUN_TIMEOUT_ERROR,
    Injection,
    LoadConfig,
    poisson_schedule,
    run_load,
)
from tandem.bench.loadgen.traces import RequestTrace
from tandem.bench.loadgen.workloads import FixedWorkload, RequestSpec, Vocab


def test_poisson_schedule_has_exponential_gaps_at_the_rate():
    offsets = np.array(poisson_schedule(rate_rps=5.0, seed=7, num_requests=20_000))
    gaps = np.diff(np.concatenate([[0.0], offsets]))
    assert len(offsets) == 20_000 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: CV 1
    # Arrivals per second are Poisson: variance equals mean.
    counts = np.bincount(offsets.astype(int))[:-1]
    assert counts.mean() == pytest.approx(5.0, rel=0.05)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.15)


def test_poisson_schedule_is_seeded_and_bounded():
    assert poisson_schedule(2.0, seed=1, num_requests=50) == poisson_schedule(2.0, 1, 50)
    assert poisson_schedule(2.0, seed=1, num_requests=50) != poisson_schedule(2.0, 2, 50)
    by_time = poisson_schedule(10.0, seed=3, duration_s=100.0)
    assert max(by_time) < 100.0 and abs(len(by_time) - 1000) < 120
    assert len(poisson_schedule(10.0, seed=3, num_requests=50, duration_s=100.0)) == 50
    assert poisson_schedule(10.0, seed=3, num_requests=50) == by_time[:50]
    with pytest.raises(ValueError):
        poisson_schedule(0.0, seed=0, num_requests=1)


class FakeClient:
    """Answers every request with `max_tokens` tokens after `delay_s`; counts concurrency."""

    def __init__(self, delay_s: float = 0.005, fail_ids: frozenset[str] = frozenset()) -> None:
        self.delay_s = delay_s
        self.fail_ids = fail_ids
        self.in_flight = 0
        self.max_in_flight = 0

    async def stream(self, spec: RequestSpec) -> RequestTrace:
        send = time.perf_counter()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            if spec.req_id in self.fail_ids:
                raise RuntimeError("client bug")
        finally:
            self.in_flight -= 1
        now = time.perf_counter()
        return RequestTrace(
            spec.req_id,
            spec.tag,
            spec.prompt_len,
            spec.max_tokens,
            send,
            now,
            [now] * spec.max_tokens,
            spec.max_tokens,
            "length",
        )


WORKLOAD = FixedWorkload(Vocab(1000, 0), input_len=4, output_len=3)


def test_closed_loop_keeps_n_in_flight_and_sends_the_first_n_requests():
    client = FakeClient()
    config = LoadConfig(concurrency=3, num_requests=20, progress=False)
    result = asyncio.run(run_load(client, WORKLOAD, config))
    assert sorted(t.req_id for t in result.traces) == sorted(f"short-{i}" for i in range(20))
    assert client.max_in_flight == 3
    assert all(t.ok and t.scheduled_s is None for t in result.traces)
    assert result.duration_s == pytest.approx(max(t.end_s for t in result.traces))
    assert min(t.send_s for t in result.traces) >= 0  # relative to the run start


def test_open_loop_sends_on_the_schedule_and_injections_come_on_top():
    long = FixedWorkload(Vocab(1000, 0), 50, 2, tag="long").request(0)
    config = LoadConfig(rate_rps=2000.0, num_requests=30, seed=4, progress=False)
    result = asyncio.run(run_load(FakeClient(), WORKLOAD, config, [Injection(0.001, long)]))
    short = [t for t in result.traces if t.tag == "short"]
    assert len(short) == 30 and [t.tag for t in result.traces].count("long") == 1
    expected = poisson_schedule(2000.0, seed=4, num_requests=30)
    scheduled = sorted(t.scheduled_s for t in short)
    assert scheduled == pytest.approx(expected)
    assert all(t.send_s >= t.scheduled_s - 1e-6 for t in short)


def test_run_timeout_cancels_and_records_open_requests():
    config = LoadConfig(concurrency=2, num_requests=10, timeout_s=0.2, progress=False)
    result = asyncio.run(run_load(FakeClient(delay_s=30.0), WORKLOAD, config))
    assert len(result.traces) == 2
    assert {t.error for t in result.traces} == {RUN_TIMEOUT_ERROR}


def test_a_raising_client_becomes_a_failed_trace():
    client = FakeClient(fail_ids=frozenset({"short-1"}))
    config = LoadConfig(concurrency=2, num_requests=4, progress=False)
    result = asyncio.run(run_load(client, WORKLOAD, config))
    errors = {t.req_id: t.error for t in result.traces}
    assert errors["short-1"] == "RuntimeError: client bug"
    assert sum(bool(e) for e in errors.values()) == 1 and len(errors) == 4


def test_load_config_is_validated():
    with pytest.raises(ValueError):
        LoadConfig(concurrency=2, rate_rps=1.0, num_requests=1)
    with pytest.raises(ValueError):
        LoadConfig(concurrency=2)
    with pytest.raises(ValueError):
        LoadConfig(rate_rps=-1.0, num_requests=1)
