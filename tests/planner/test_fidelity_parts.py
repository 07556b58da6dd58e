"""The fidelity benchmark's pure parts: run plans, rate bracketing, reasons for misses."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tandem.bench.loadgen.load import poisson_schedule
from tandem.bench.planner.fidelity_sweep import SweepSettings, next_rate
from tandem.bench.planner.fidelity_table import METRICS, Pair, Row, misses, reasons, render


def test_run_plan_is_the_load_generators_schedule_and_cuts_after_the_last_arrival():
    settings = SweepSettings(duration_s=10.0, grace_s=5.0, min_requests=8)
    plan = settings.run_plan(2.0, seed=7)
    assert plan.num_requests == 20
    assert plan.schedule == poisson_schedule(2.0, 7, 20, plan.window_s)
    assert plan.cut_s == pytest.approx(plan.schedule[-1] + 5.0)
    # A low rate still sends min_requests (the window stretches), a cap bounds a high one.
    assert settings.run_plan(0.01, seed=101).num_requests == 8
    assert SweepSettings(max_requests=5).run_plan(50.0, seed=1).num_requests == 5


def _point(rate: float, attainment: float) -> Any:
    return SimpleNamespace(rate_rps=rate, met=attainment >= 0.9)


def test_next_rate_brackets_then_refines_then_stops():
    settings = SweepSettings(step=1.5, close_enough=1.25)
    assert next_rate([_point(1.0, 1.0)], settings) == pytest.approx(1.5)
    assert next_rate([_point(1.0, 0.5)], settings) == pytest.approx(1 / 1.5)
    assert next_rate([_point(1.0, 1.0), _point(1.5, 0.5)], settings) == pytest.approx(1.5**0.5)
    assert next_rate([_point(1.0, 1.0), _point(1.2, 0.5)], settings) is None


def _row(goodput: Pair, sim_scale: float, unshared_scale: float, local: Pair) -> Row:
    return Row(
        "1P+1D", "chat", goodput, goodput.sim, goodput.sim, 1.0,
        {m: Pair(sim_scale, 1.0) for m in METRICS}, dict.fromkeys(METRICS, unshared_scale),
        100, local, 0, 0.5, 2,
    )  # fmt: skip


def test_a_row_on_target_needs_no_reason_and_a_miss_names_its_evidence():
    on = _row(Pair(1.1, 1.0), 1.2, 2.0, Pair(0.5, 0.5))
    assert misses(on) == [] and reasons(on) == ""
    off = _row(Pair(1.0, 2.0), 1.5, 1.1, Pair(0.2, 0.8))
    assert misses(off) == ["goodput", *METRICS]
    why = reasons(off)
    assert "closer without core sharing" in why
    assert "the router prefilled 80% on the decode worker" in why


def test_an_unbracketed_goodput_is_a_bound_and_a_miss():
    row = _row(Pair(1.0, 1.0), 1.0, 1.0, Pair(0.5, 0.5))
    above = Row(**{**row.__dict__, "goodput_bound": ">"})
    assert misses(above) == ["goodput"]
    assert "every swept rate met the target" in reasons(above)
    assert "> 1" in render([above])


def test_a_metric_without_values_renders_as_a_dash():
    row = _row(Pair(1.0, 1.0), float("nan"), 1.0, Pair(0.5, 0.5))
    assert "- / 1 (-)" in render([row])
    assert "nan" not in render([row])
