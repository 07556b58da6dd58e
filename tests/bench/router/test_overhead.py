"""The router-overhead benchmark's pure parts on synthetic numbers (no timing is asserted)."""

from __future__ import annotations

import pytest

from tandem.bench.cli import parse_args
from tandem.bench.loadgen.metrics import Distribution
from tandem.bench.loadgen.traces import RequestTrace
from tandem.bench.loadgen.workloads import TextPrompts
from tandem.bench.router.overhead import (
    OverheadResult,
    ThroughputResult,
    paired_differences,
    render_section,
    throughput_of,
)


def test_paired_differences():
    assert paired_differences([3.0, 5.0], [1.0, 4.0]) == [2.0, 1.0]
    with pytest.raises(ValueError):
        paired_differences([1.0], [1.0, 2.0])


def test_text_workload_sends_the_same_text_with_its_own_ids():
    workload = TextPrompts(0, 4, text="hello there")
    first, second = workload.request(0), workload.request(1)
    assert first.prompt_text == second.prompt_text == "hello there"
    assert first.max_tokens == 4 and first.req_id != second.req_id


def test_parse_args_quick():
    args = parse_args(["router", "--quick", "--concurrency", "8"])
    assert args.requests == 20 and args.concurrency == [8] and args.duration == 3.0


def _trace(send: float, first: float, end: float, error: str = "") -> RequestTrace:
    times = [] if error else [first, end]
    return RequestTrace("r", "short", 5, 4, send, end, times, len(times), error=error)


def test_throughput_counts_what_finished_inside_the_window():
    traces = [
        _trace(0.5, 0.6, 1.5),  # warm-up: ends before the window
        _trace(2.0, 2.1, 2.5),
        _trace(3.0, 3.2, 4.0),
        _trace(3.5, 0.0, 3.6, error="UNAVAILABLE: gone"),
        _trace(11.5, 11.6, 12.5),  # ends after the window
    ]
    cpu = ({"router": 1.0, "gone": None}, {"router": 6.0, "gone": 2.0})
    result = throughput_of(traces, concurrency=2, window=(2.0, 12.0), cpu=cpu)
    assert result.num_completed == 2
    assert result.requests_per_s == pytest.approx(0.2)
    assert result.errors == {"UNAVAILABLE": 1}
    assert result.latency.max == pytest.approx(1.0)
    assert result.ttft.p50 == pytest.approx(0.15)
    assert result.cpu_utilization == {"router": pytest.approx(0.5)}


def _dist(p50: float, p99: float) -> Distribution:
    return Distribution(100, p50, p50, p99, p99, p99)


def _closed_loop(concurrency: int, rps: float, router_cpu: float) -> ThroughputResult:
    return ThroughputResult(
        concurrency=concurrency,
        duration_s=10.0,
        num_completed=int(rps * 10),
        errors={},
        requests_per_s=rps,
        latency=_dist(0.05, 0.1),
        ttft=_dist(0.04, 0.08),
        cpu_utilization={"router": router_cpu, "fake workers": 0.4, "load generator": 0.3},
    )


def _report(router_cpu: float) -> dict:
    overhead = OverheadResult(
        num_requests=200,
        num_prompt_tokens=45,
        max_tokens=4,
        router_e2e=_dist(0.030, 0.040),
        direct_e2e=_dist(0.026, 0.032),
        router_ttft=_dist(0.012, 0.018),
        direct_ttft=_dist(0.009, 0.011),
        added_e2e=_dist(0.004, 0.012),
        added_ttft=_dist(0.003, 0.007),
        outputs_match=True,
    )
    machine = {
        "cpu": "CPU", "cores": 2, "python": "3.11", "grpc": "1.85",
        "started": "2026-01-01 00:00 UTC", "load_avg_at_start": [1.0, 1.0, 1.0],
    }  # fmt: skip
    return {
        "command": "tandem-bench router",
        "wall_s": 60.0,
        "machine": machine,
        "load_average_end": (2.0, 1.5, 1.0),
        "overhead": overhead,
        "cores": ((0,), (1,)),
        "throughput": (_closed_loop(16, 250.0, router_cpu), _closed_loop(64, 300.0, router_cpu)),
    }


def test_render_section_has_both_tables_and_the_command():
    run, overhead, throughput = render_section(_report(router_cpu=0.99))
    assert "```\n.venv/bin/tandem-bench router\n```" in run
    assert "| TTFT | 12.00 ms | 18.00 ms | 9.00 ms | 11.00 ms | 3.00 ms | 7.00 ms |" in overhead
    assert "same greedy tokens" in overhead
    assert "| 64 | 300 | 50.00 ms | 100.00 ms | 40.00 ms | 99% | 40% | 30% | 0 |" in throughput
    assert "router on core 0" in throughput
