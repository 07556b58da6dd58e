"""The SLO benchmark's arithmetic and report on synthetic outcomes (no timing is asserted)."""

from __future__ import annotations

import math

import pytest

from tandem.bench.router_load import StreamTiming
from tandem.bench.router_report import LatencySummary, MachineFacts
from tandem.bench.slo_bench import parse_args
from tandem.bench.slo_load import parse_samples
from tandem.bench.slo_metrics import (
    Outcome,
    Probe,
    capacity_of,
    mean_itl_s,
    outcome_of,
    poisson_arrivals,
    summarize,
)
from tandem.bench.slo_report import (
    Calibration,
    PolicyRun,
    RunSetup,
    SloBenchReport,
    reading,
    render_section,
)


def test_poisson_arrivals_are_seeded_sorted_and_in_the_window():
    arrivals = poisson_arrivals(100.0, 100.0, seed=7)
    assert arrivals == poisson_arrivals(100.0, 100.0, seed=7)
    assert arrivals != poisson_arrivals(100.0, 100.0, seed=8)
    assert all(0 < a < 100.0 for a in arrivals)
    assert arrivals == sorted(arrivals)
    # 10,000 expected; the Poisson sd is 100, so 5 sd either way.
    assert 9_500 < len(arrivals) < 10_500
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 10.0, seed=0)


def test_mean_itl_is_the_mean_gap_after_the_first_token():
    assert mean_itl_s([1.0]) is None
    assert mean_itl_s([]) is None
    assert mean_itl_s([1.0, 1.1, 1.3, 1.6]) == pytest.approx(0.2)


def _finished(ttft: float, itl: float | None = 0.05, sent: float = 0.0) -> Outcome:
    return Outcome(sent, "", True, ttft, itl, ttft + 0.2)


SHED = Outcome(0.0, "RESOURCE_EXHAUSTED", False, None, None, 0.003)
# The decode worker ran out of blocks after the first token: admitted, then failed.
LATE_EXHAUSTED = Outcome(0.0, "RESOURCE_EXHAUSTED", True, 0.1, None, 30.0)
TIMED_OUT = Outcome(0.0, "DEADLINE_EXCEEDED", False, None, None, 120.0)


def test_outcome_classes():
    assert SHED.shed and not SHED.admitted and not SHED.finished
    assert LATE_EXHAUSTED.admitted and not LATE_EXHAUSTED.shed
    assert TIMED_OUT.admitted and not TIMED_OUT.attained(1.0, None)
    ok = _finished(0.2, itl=0.05)
    assert ok.attained(0.2, None)
    assert not ok.attained(0.19, None)
    assert ok.attained(0.2, 0.05) and not ok.attained(0.2, 0.04)
    # One token only: no ITL to miss.
    assert _finished(0.1, itl=None).attained(0.2, 0.01)


def test_outcome_of_a_stream_timing():
    timing = StreamTiming(
        start_s=100.0,
        first_token_s=100.2,
        end_s=100.5,
        token_times_s=(100.2, 100.3, 100.5),
        token_ids=(1, 2, 3),
        finished=True,
    )
    outcome = outcome_of(timing, run_start_s=99.0)
    assert outcome.sent_at_s == pytest.approx(1.0)
    assert outcome.ttft_s == pytest.approx(0.2)
    assert outcome.mean_itl_s == pytest.approx(0.15)
    assert outcome.e2e_s == pytest.approx(0.5)
    assert outcome.finished and outcome.admitted


def test_summarize_counts_attainment_of_admitted_and_goodput():
    outcomes = [
        _finished(0.1),
        _finished(0.2),
        _finished(0.3),
        _finished(0.9),  # misses the 0.5 s target
        SHED,
        SHED,
        LATE_EXHAUSTED,  # admitted, failed
        TIMED_OUT,  # admitted, failed
    ]
    s = summarize(outcomes, duration_s=2.0, ttft_target_s=0.5)
    assert (s.num_offered, s.num_shed, s.num_failed, s.num_attained) == (8, 2, 2, 3)
    assert s.offered_rate == 4.0
    assert s.admitted_fraction == pytest.approx(6 / 8)
    assert s.attainment == pytest.approx(3 / 6)
    assert s.goodput == pytest.approx(1.5)
    assert s.errors == {"RESOURCE_EXHAUSTED": 1, "DEADLINE_EXCEEDED": 1}
    assert s.ttft.count == 4 and s.ttft.max_s == pytest.approx(0.9)
    assert s.shed_latency.count == 2


def test_summarize_with_everything_shed():
    s = summarize([SHED, SHED], duration_s=1.0, ttft_target_s=0.5)
    assert s.admitted_fraction == 0.0
    assert math.isnan(s.attainment)
    assert s.goodput == 0.0
    with pytest.raises(ValueError):
        summarize([], duration_s=0.0, ttft_target_s=0.5)


def _probe(rate: float, attained: int, of: int) -> Probe:
    outcomes = [_finished(0.1)] * attained + [_finished(9.0)] * (of - attained)
    return Probe(rate, summarize(outcomes, 10.0, ttft_target_s=0.5))


def test_capacity_is_the_last_rate_before_the_first_miss():
    probes = [_probe(1.0, 10, 10), _probe(2.0, 19, 20), _probe(3.0, 5, 10), _probe(4.0, 10, 10)]
    assert capacity_of(probes, 0.9) == 2.0
    assert capacity_of(probes[:2], 0.9) == 2.0
    assert capacity_of([_probe(1.0, 1, 10)], 0.9) is None
    assert capacity_of([], 0.9) is None


def test_parse_samples_keeps_wanted_counters_without_the_model_label():
    text = "\n".join(
        [
            "# HELP tandem:requests_rejected_total Requests shed or refused.",
            "# TYPE tandem:requests_rejected_total counter",
            'tandem:requests_rejected_total{model_name="m",reason="overloaded"} 12.0',
            'tandem:requests_rejected_created{model_name="m",reason="overloaded"} 1.7e9',
            'tandem:disagg_decisions_total{model_name="m",decision="local_prefill"} 3.0',
            'tandem:goodput_requests_total{model_name="m"} 40.0',
            "plain_total 1.0",
        ]
    )
    samples = parse_samples(text, ["tandem:requests_rejected_total", "plain"])
    assert samples == {
        'tandem:requests_rejected_total{reason="overloaded"}': 12.0,
        "plain_total": 1.0,
    }


def test_parse_args_quick_shortens_the_run():
    args = parse_args(["--quick", "--preset", "tiny"])
    assert args.duration < 40 and args.max_probes <= 3
    assert str(args.model) == "models/tandem-tiny"


def _report(shed_attained: int, none_attained: int) -> SloBenchReport:
    def run(label: str, policy: str, attained: int, num_shed: int) -> PolicyRun:
        admitted = 100 - num_shed
        outcomes = (
            [_finished(0.1)] * attained
            + [_finished(2.0)] * (admitted - attained)
            + [SHED] * num_shed
        )
        return PolicyRun(
            RunSetup(label, policy),
            summarize(outcomes, 20.0, ttft_target_s=0.5),
            {'tandem:requests_rejected_total{reason="overloaded"}': float(num_shed)},
            (1.0, 1.0, 1.0),
            (2.0, 1.0, 1.0),
        )

    summary = LatencySummary(16, 0.15, 0.15, 0.2, 0.2, 0.2)
    calibration = Calibration(
        num_prompt_tokens=45.0,
        unloaded_ttft=summary,
        unloaded_e2e=summary,
        unloaded_itl=summary,
        ttft_target_s=0.5,
        probes=(_probe(2.0, 10, 10), _probe(2.6, 5, 10)),
        capacity_per_s=2.0,
    )
    machine = MachineFacts("CPU", 2, "3.11", "1.85", "2.60", "2026-01-01 00:00 UTC", (1, 1, 1))
    return SloBenchReport(
        command="python -m bench.slo_bench",
        wall_s=300.0,
        machine=machine,
        load_average_end=(2.0, 1.5, 1.0),
        model="small",
        max_tokens=4,
        calibration=calibration,
        offered_rate_per_s=4.0,
        duration_s=20.0,
        seed=0,
        runs=(
            run("shed", "shed", shed_attained, num_shed=50),
            run("none", "none", none_attained, num_shed=0),
        ),
    )


def test_reading_says_whether_the_target_was_met():
    met = reading(_report(shed_attained=48, none_attained=30))
    assert met.startswith("**Target met**") and "96%" in met and "30%" in met
    missed = reading(_report(shed_attained=40, none_attained=30))
    assert missed.startswith("**Target missed**") and "80%" in missed


def test_render_section_tables():
    text = render_section(_report(shed_attained=48, none_attained=30))
    assert "| 2.00 | 10 | 10 | 100% |" in text  # the passing probe: rate, s, requests
    assert "**2.00 req/s**" in text
    assert "| shed | `shed` | 0 | 5.00 (100) | 50% | 50 | 0 | **96%** | 2.40 |" in text
    assert "| none | `none` | 0 | 5.00 (100) | 100% | 0 | 0 | **30%** | 1.50 |" in text
