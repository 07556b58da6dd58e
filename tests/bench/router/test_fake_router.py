"""The router-throughput half of `tandem-bench router` end to end, but short: fake
workers and a real router as harness processes, the load generator's closed loop."""

from __future__ import annotations

import argparse
import os

import pytest

from tandem.bench.router.overhead import measure_throughput, render_throughput

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def test_fake_workers_and_router_serve_a_closed_loop(tiny_model_dir, tmp_path):
    affinity = os.sched_getaffinity(0)
    args = argparse.Namespace(
        model=tiny_model_dir,
        json=tmp_path / "router.json",
        concurrency=[2],
        duration=1.0,
        max_tokens=4,
    )
    (result,) = measure_throughput(args)
    assert os.sched_getaffinity(0) == affinity  # the load generator's pinning is undone
    assert result.concurrency == 2 and result.errors == {}
    assert result.num_completed > 0
    assert result.requests_per_s == pytest.approx(result.num_completed / 1.0)
    assert 0 < result.latency.p50 < 1.0 and 0 < result.ttft.p50 <= result.latency.p50
    assert set(result.cpu_utilization) == {"router", "fake workers", "load generator"}
    assert result.cpu_utilization["router"] > 0
    assert "| 2 |" in render_throughput((result,))
    # Both servers logged next to the results and were stopped.
    assert {p.name for p in (tmp_path / "logs").iterdir()} == {
        "fake-workers.log",
        "fake-router.log",
    }
