"""Head-of-line windows on synthetic traces whose gaps are known."""

from __future__ import annotations

import math

import pytest

from tandem.bench.experiments.head_of_line import JOIN_WINDOW_S, head_of_line_stats
from tandem.bench.loadgen.traces import RequestTrace


def trace(times: list[float], tag: str = "short", send: float = 0.0, req_id: str = "s"):
    return RequestTrace(
        req_id=req_id,
        tag=tag,
        prompt_len=8,
        max_tokens=len(times),
        send_s=send,
        end_s=times[-1] if times else send,
        token_times_s=times,
        num_output_tokens=len(times),
        finish_reason="length",
    )


def steady(start: float, end: float, gap: float) -> list[float]:
    count = round((end - start) / gap)
    return [start + i * gap for i in range(count + 1)]


def test_a_stall_during_the_long_prefill_is_measured_against_the_steady_gaps():
    # Short request: 0.1 s gaps, except one 3 s stall (10.0 → 13.0) while the long
    # prompt (sent at 10.0, first token at 13.0) is prefilled; 0.1 s gaps after it.
    times = [*steady(0.0, 10.0, 0.1), *steady(13.0, 20.0, 0.1)]
    long = trace([13.0, 13.1], tag="long", send=10.0, req_id="long")
    stats = head_of_line_stats([trace(times), long], ramp_s=2.0)
    assert stats.long_prefill_s == pytest.approx(3.0)
    assert stats.baseline_p99_s == pytest.approx(0.1)
    assert stats.baseline_count == 80  # gaps inside [2.0, 10.0]
    assert stats.during_count == 1
    assert stats.during_p99_s == pytest.approx(3.0)
    assert stats.during_max_s == pytest.approx(3.0)
    assert stats.during_over_baseline == pytest.approx(30.0)
    assert stats.join_p99_s == pytest.approx(0.1)
    assert stats.arrivals_during == 0


def test_short_requests_sent_during_the_prefill_report_their_ttft():
    long = trace([13.0, 13.1], tag="long", send=10.0, req_id="long")
    waited = trace([17.0, 17.1], send=11.0, req_id="waited")  # TTFT 6 s
    quick = trace([12.2, 12.3], send=12.0, req_id="quick")  # TTFT 0.2 s
    after = trace([14.0, 14.1], send=13.5, req_id="after")  # sent after the prefill
    stats = head_of_line_stats([trace(steady(0.0, 20.0, 0.1)), long, waited, quick, after])
    assert stats.arrivals_during == 2
    assert stats.arrivals_ttft_max_s == pytest.approx(6.0)


def test_unaffected_decodes_keep_their_gaps_and_join_costs_show_separately():
    times = [*steady(0.0, 13.0, 0.1), 13.5, *steady(13.6, 20.0, 0.1)]
    long = trace([13.0, 13.1], tag="long", send=10.0, req_id="long")
    stats = head_of_line_stats([trace(times), long], ramp_s=2.0)
    assert stats.during_p99_s == pytest.approx(0.1)
    assert stats.during_over_baseline == pytest.approx(1.0)
    # The 0.5 s gap (13.0 → 13.5) starts at the long prompt's first token: join window.
    assert stats.join_max_s == pytest.approx(0.5)
    assert JOIN_WINDOW_S > 0.5


def test_failed_short_requests_are_left_out_and_one_long_request_is_required():
    failed = RequestTrace("f", "short", 8, 4, 0.0, 12.0, [11.0, 12.0], 2, "", "UNAVAILABLE: x")
    long = trace([13.0], tag="long", send=10.0)
    stats = head_of_line_stats([trace(steady(0.0, 20.0, 0.1)), failed, long], ramp_s=2.0)
    assert stats.during_max_s == pytest.approx(0.1)
    with pytest.raises(ValueError):
        head_of_line_stats([trace(steady(0.0, 20.0, 0.1))])
    no_gaps = head_of_line_stats([long], ramp_s=2.0)
    assert math.isnan(no_gaps.baseline_p99_s) and no_gaps.during_count == 0
