"""The SLO benchmark's arithmetic and report on synthetic traces (no timing is asserted)."""

from __future__ import annotations

import math

import pytest

from tandem.bench.cli import parse_args
from tandem.bench.loadgen.metrics import Distribution
from tandem.bench.loadgen.traces import RequestTrace
from tandem.bench.loadgen.workloads import TextPrompts
from tandem.bench.router.slo import (
    Calibration,
    PolicyRun,
    Probe,
    RunSetup,
    capacity_of,
    is_shed,
    parse_samples,
    render_section,
    summarize,
)


def test_text_prompts_share_no_prefix_and_are_pure_functions_of_seed_and_index():
    prompts = TextPrompts(seed=3, max_tokens=2)
    texts = [prompts.request(i).prompt_text for i in range(5)]
    assert len(set(texts)) == 5
    assert all(t.startswith(f"3-{i}: ") for i, t in enumerate(texts))
    assert all(len(t.split()) == 41 for t in texts)
    assert prompts.request(4).prompt_text == texts[4]
    assert TextPrompts(seed=4, max_tokens=2).request(0).prompt_text != texts[0]


def _finished(ttft: float, itl: float = 0.05) -> RequestTrace:
    times = [ttft, ttft + itl]
    return RequestTrace("r", "short", 45, 2, 0.0, ttft + 0.2, times, 2, "length")


def _failed(error: str, end: float, tokens: tuple[float, ...] = ()) -> RequestTrace:
    return RequestTrace("r", "short", 45, 2, 0.0, end, list(tokens), len(tokens), error=error)


SHED = _failed("RESOURCE_EXHAUSTED: overloaded", 0.003)
# The decode worker ran out of blocks after the first token: admitted, then failed.
LATE_EXHAUSTED = _failed("RESOURCE_EXHAUSTED: no blocks", 30.0, (0.1,))
TIMED_OUT = _failed("DEADLINE_EXCEEDED: late", 120.0)


def test_only_a_rejection_before_any_token_is_shed():
    assert is_shed(SHED)
    assert not is_shed(LATE_EXHAUSTED) and not is_shed(TIMED_OUT)
    assert not is_shed(_finished(0.2))


def test_attainment_is_ttft_within_the_target():
    ok = [_finished(0.2)]
    assert summarize(ok, 1.0, ttft_target_s=0.2).admitted.slo_attainment == 1.0
    assert summarize(ok, 1.0, ttft_target_s=0.19).admitted.slo_attainment == 0.0


def test_summarize_counts_attainment_of_admitted_and_goodput():
    traces = [
        _finished(0.1),
        _finished(0.2),
        _finished(0.3),
        _finished(0.9),  # misses the 0.5 s target
        SHED,
        SHED,
        LATE_EXHAUSTED,  # admitted, failed
        TIMED_OUT,  # admitted, failed
    ]
    s = summarize(traces, duration_s=2.0, ttft_target_s=0.5)
    a = s.admitted
    assert (s.num_offered, s.num_shed, a.num_requests, a.num_failed) == (8, 2, 6, 2)
    assert s.offered_rate == 4.0
    assert s.admitted_fraction == pytest.approx(6 / 8)
    assert a.slo_attainment == pytest.approx(3 / 6)
    assert a.goodput_rps == pytest.approx(1.5)
    assert a.errors == {"RESOURCE_EXHAUSTED": 1, "DEADLINE_EXCEEDED": 1}
    assert a.ttft_s.count == 4 and a.ttft_s.max == pytest.approx(0.9)
    assert a.tpot_s.p50 == pytest.approx(0.05)
    assert s.shed_latency.count == 2


def test_summarize_with_everything_shed():
    s = summarize([SHED, SHED], duration_s=1.0, ttft_target_s=0.5)
    assert s.admitted_fraction == 0.0
    assert math.isnan(s.admitted.slo_attainment)
    assert s.admitted.goodput_rps == 0.0
    with pytest.raises(ValueError):
        summarize([], duration_s=0.0, ttft_target_s=0.5)


def _probe(rate: float, attained: int, of: int) -> Probe:
    traces = [_finished(0.1)] * attained + [_finished(9.0)] * (of - attained)
    return Probe(rate, summarize(traces, 10.0, ttft_target_s=0.5))


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
    args = parse_args(["slo", "--quick", "--preset", "tiny"])
    assert args.duration < 40 and args.max_probes <= 3
    assert str(args.model) == "models/tandem-tiny"


def _report(shed_attained: int, none_attained: int) -> dict:
    def run(label: str, policy: str, attained: int, num_shed: int) -> PolicyRun:
        admitted = 100 - num_shed
        traces = (
            [_finished(0.1)] * attained
            + [_finished(2.0)] * (admitted - attained)
            + [SHED] * num_shed
        )
        return PolicyRun(
            RunSetup(label, policy),
            summarize(traces, 20.0, ttft_target_s=0.5),
            {'tandem:requests_rejected_total{reason="overloaded"}': float(num_shed)},
            (1.0, 1.0, 1.0),
            (2.0, 1.0, 1.0),
        )

    summary = Distribution(16, 0.15, 0.15, 0.2, 0.2, 0.2)
    calibration = Calibration(
        num_prompt_tokens=45.0,
        unloaded_ttft=summary,
        unloaded_e2e=summary,
        unloaded_itl=summary,
        ttft_target_s=0.5,
        probes=(_probe(2.0, 10, 10), _probe(2.6, 5, 10)),
        capacity_per_s=2.0,
    )
    machine = {
        "cpu": "CPU", "cores": 2, "python": "3.11", "grpc": "1.85",
        "started": "2026-01-01 00:00 UTC", "load_avg_at_start": [1.0, 1.0, 1.0],
    }  # fmt: skip
    return {
        "command": "tandem-bench slo",
        "wall_s": 300.0,
        "machine": machine,
        "load_average_end": (2.0, 1.5, 1.0),
        "model": "small",
        "max_tokens": 4,
        "calibration": calibration,
        "offered_rate_per_s": 4.0,
        "duration_s": 20.0,
        "seed": 0,
        "runs": (
            run("shed", "shed", shed_attained, num_shed=50),
            run("none", "none", none_attained, num_shed=0),
        ),
    }


def test_render_section_tables():
    run, results = render_section(_report(shed_attained=48, none_attained=30))
    text = f"{run}\n{results}"
    assert "```\n.venv/bin/tandem-bench slo\n```" in text
    assert "| 2.00 | 10 | 10 | 100% |" in text  # the passing probe: rate, s, requests
    assert "**2.00 req/s**" in text
    assert "| shed | `shed` | 0 | 5.00 (100) | 50% | 50 | 0 | **96%** | 2.40 |" in text
    assert "| none | `none` | 0 | 5.00 (100) | 100% | 0 | 0 | **30%** | 1.50 |" in text
