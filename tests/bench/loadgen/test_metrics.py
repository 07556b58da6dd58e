"""Load-generator metrics on synthetic token traces whose answers are worked out by hand."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tandem.bench.loadgen.metrics import (
    Distribution,
    SloTargets,
    e2e_s,
    goodput_rps,
    itl_gaps_s,
    meets_slo,
    percentile,
    slo_attainment,
    summarize,
    tpot_s,
    ttft_s,
)
from tandem.bench.loadgen.traces import RequestTrace


def trace(
    token_times: list[float],
    send: float = 0.0,
    end: float | None = None,
    num_tokens: int | None = None,
    error: str = "",
    req_id: str = "r",
    prompt_len: int = 10,
    tag: str = "short",
) -> RequestTrace:
    return RequestTrace(
        req_id=req_id,
        tag=tag,
        prompt_len=prompt_len,
        max_tokens=16,
        send_s=send,
        end_s=end if end is not None else (token_times[-1] if token_times else send),
        token_times_s=token_times,
        num_output_tokens=len(token_times) if num_tokens is None else num_tokens,
        finish_reason="" if error else "length",
        error=error,
    )


def test_percentile_interpolates_linearly():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    assert percentile([3, 1, 2], 0) == 1 and percentile([3, 1, 2], 100) == 3
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_percentile_equals_numpy_default():
    values = list(np.random.default_rng(3).exponential(1.0, size=257))
    for q in (0, 1, 37.5, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_per_request_latencies():
    # Sent at 1.0; token 1 at 1.5; a chunk of two tokens at 1.6; the 4th at 1.9; closed 2.0.
    t = trace([1.5, 1.6, 1.6, 1.9], send=1.0, end=2.0)
    assert ttft_s(t) == pytest.approx(0.5)
    assert itl_gaps_s(t) == pytest.approx([0.1, 0.0, 0.3])
    assert tpot_s(t) == pytest.approx(0.4 / 3)
    assert e2e_s(t) == pytest.approx(1.0)


def test_tpot_uses_the_servers_token_count_when_chunks_merge_tokens():
    # Two chunks but the server said five tokens: four intervals over 1 s.
    t = trace([1.0, 2.0], num_tokens=5)
    assert tpot_s(t) == pytest.approx(0.25)
    assert itl_gaps_s(t) == pytest.approx([1.0])


def test_tpot_and_ttft_undefined_without_enough_tokens():
    assert tpot_s(trace([0.3])) is None
    assert ttft_s(trace([])) is None
    assert itl_gaps_s(trace([0.3])) == []


def slo_traces() -> list[RequestTrace]:
    return [
        trace([0.5, 0.6, 0.7], req_id="meets"),  # TTFT 0.5, TPOT 0.1
        trace([2.0, 2.1], req_id="slow-first-token"),  # TTFT 2.0 > 1.0
        trace([0.2, 0.7, 1.2], req_id="slow-tokens"),  # TPOT 0.5 > 0.2
        trace([], error="UNAVAILABLE: gone", req_id="failed"),
        trace([0.2], req_id="one-token"),  # no TPOT: judged on TTFT alone
    ]


def test_slo_attainment_counts_failures_as_misses():
    slo = SloTargets(ttft_s=1.0, itl_s=0.2)
    met = [t.req_id for t in slo_traces() if meets_slo(t, slo)]
    assert met == ["meets", "one-token"]
    assert slo_attainment(slo_traces(), slo) == pytest.approx(2 / 5)
    assert goodput_rps(slo_traces(), slo, duration_s=4.0) == pytest.approx(0.5)


def test_slo_limits_are_inclusive_and_each_target_optional():
    t = trace([1.0, 1.2, 1.4])  # TTFT 1.0, TPOT 0.2 (exactly on both targets)
    assert meets_slo(t, SloTargets(ttft_s=1.0, itl_s=0.2 + 1e-12))
    assert not meets_slo(t, SloTargets(ttft_s=0.99))
    assert not meets_slo(t, SloTargets(itl_s=0.19))
    assert meets_slo(t, SloTargets())
    assert not meets_slo(trace([], end=1.0), SloTargets())  # succeeded with no token
    assert math.isnan(slo_attainment([], SloTargets()))
    with pytest.raises(ValueError):
        SloTargets(ttft_s=0)


def test_summarize_a_run():
    traces = slo_traces()
    summary = summarize(traces, duration_s=4.0, slo=SloTargets(1.0, 0.2))
    assert (summary.num_requests, summary.num_succeeded, summary.num_failed) == (5, 4, 1)
    assert summary.errors == {"UNAVAILABLE": 1}
    assert summary.request_throughput_rps == pytest.approx(1.0)
    assert summary.total_output_tokens == 3 + 2 + 3 + 1
    assert summary.output_throughput_tps == pytest.approx(9 / 4)
    assert summary.total_input_tokens == 40
    # TTFTs of the 4 successes: 0.5, 2.0, 0.2, 0.2.
    assert summary.ttft_s.count == 4
    assert summary.ttft_s.mean == pytest.approx(0.725)
    assert summary.ttft_s.p50 == pytest.approx(0.35)
    assert summary.ttft_s.max == pytest.approx(2.0)
    # ITL pools every gap: 0.1, 0.1 | 0.1 | 0.5, 0.5.
    assert summary.itl_s.count == 5
    assert summary.itl_s.mean == pytest.approx(1.3 / 5)
    assert summary.itl_s.p50 == pytest.approx(0.1)
    # TPOT per request: 0.1, 0.1, 0.5 (one-token request has none).
    assert summary.tpot_s.count == 3
    assert summary.tpot_s.p90 == pytest.approx(0.1 + 0.8 * 0.4)
    assert summary.slo_attainment == pytest.approx(0.4)
    assert summary.goodput_rps == pytest.approx(0.5)


def test_summary_json_turns_nan_into_null():
    summary = summarize([trace([], error="HTTP 429: busy")], duration_s=2.0)
    data = summary.to_json()
    assert data["ttft_s"]["mean"] is None and data["ttft_s"]["count"] == 0
    assert data["errors"] == {"HTTP 429": 1}
    assert data["slo_attainment"] == 0.0
    assert json.loads(json.dumps(data)) == data  # plain JSON, no NaN


def test_distribution_of_known_values():
    d = Distribution.of([0.4, 0.1, 0.3, 0.2])
    assert (d.count, d.max) == (4, 0.4)
    assert d.mean == pytest.approx(0.25)
    assert d.p50 == pytest.approx(0.25)
    assert d.p99 == pytest.approx(0.397)


def test_long_documents_have_a_ttft_target_of_their_own():
    slo = SloTargets(ttft_s=1.0, itl_s=0.5, long_ttft_s=5.0)
    short, document = trace([3.0, 3.2]), trace([3.0, 3.2], tag="long")
    assert not meets_slo(short, slo)
    assert meets_slo(document, slo)
    assert not meets_slo(trace([3.0, 4.0], tag="long"), slo)  # TPOT 1.0 > 0.5
    assert not meets_slo(trace([6.0, 6.1], tag="long"), slo)
    # Without a document target, documents are held to the common one.
    assert not meets_slo(document, SloTargets(ttft_s=1.0))
    with pytest.raises(ValueError):
        SloTargets(long_ttft_s=0)
