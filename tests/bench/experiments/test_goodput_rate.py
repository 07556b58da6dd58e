"""The sustained rate (goodput) read off a rate sweep, on synthetic summaries."""

from __future__ import annotations

import math

import pytest

from tandem.bench.experiments.goodput import highest_rate_meeting, ratio_rows, sustained_rate
from tandem.bench.loadgen.metrics import summarize
from tandem.bench.loadgen.tables import SweepPoint
from tandem.bench.loadgen.traces import RequestTrace


def point(rate: float, attainment: float) -> SweepPoint:
    """A sweep point whose SLO attainment is `attainment` (of 20 requests)."""
    met = round(attainment * 20)
    traces = [
        RequestTrace(
            f"r{i}", "short", 8, 2, 0.0, 1.0, [0.5, 1.0], 2, "length", "" if i < met else "timeout"
        )
        for i in range(20)
    ]
    return SweepPoint(summarize(traces, duration_s=10.0), rate_rps=rate)


def test_goodput_interpolates_where_attainment_crosses_ninety_percent():
    points = [point(1.0, 1.0), point(2.0, 0.95), point(3.0, 0.75), point(4.0, 0.5)]
    assert highest_rate_meeting(points) == 2.0
    # 0.95 at 2 → 0.75 at 3: 90% is a quarter of the way.
    assert sustained_rate(points) == pytest.approx(2.25)
    # Order of the points does not matter.
    assert sustained_rate(list(reversed(points))) == pytest.approx(2.25)


def test_goodput_edges():
    assert sustained_rate([point(1.0, 1.0), point(2.0, 0.9)]) == 2.0  # all meet: highest
    assert sustained_rate([point(1.0, 0.5), point(2.0, 0.2)]) == 0.0  # none meets
    assert highest_rate_meeting([point(1.0, 0.5)]) == 0.0
    # A rate that recovers after a miss does not count: the first miss ends the range.
    assert sustained_rate([point(1.0, 1.0), point(2.0, 0.8), point(3.0, 0.95)]) == pytest.approx(
        1.5
    )


def test_ratios_name_each_pair():
    rows = ratio_rows(
        {"a": [point(1.0, 1.0), point(2.0, 1.0)], "b": [point(1.0, 1.0), point(2.0, 0.5)]}
    )
    # a sustains 2.0; b: 1.0 → 2.0 crossing at 1 + (1 - 0.9)/(1 - 0.5) = 1.2.
    assert rows == [["a ÷ b", f"{2.0 / 1.2:.2f}×"]]
    assert not math.isnan(sustained_rate([point(1.0, 1.0)]))
