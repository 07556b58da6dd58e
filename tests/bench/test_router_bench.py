"""The router benchmark's pure helpers on synthetic numbers (no timing is asserted)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import pytest

from tandem.bench.doc_sections import replace_section
from tandem.bench.router_bench import (
    RouterBenchReport,
    ThroughputSetup,
    parse_args,
    render_section,
    throughput_reading,
)
from tandem.bench.router_load import ClosedLoopResult, StreamTiming, distinct_prompts
from tandem.bench.router_overhead import OverheadResult
from tandem.bench.router_procs import process_cpu_s
from tandem.bench.router_report import (
    LatencySummary,
    MachineFacts,
    format_ms,
    format_table,
    paired_differences,
    percentile,
    write_json,
)


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    # rank (n-1)·q = 3·0.99 = 2.97 → 3 + 0.97·(4 - 3)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0


@pytest.mark.parametrize("values, q", [([], 50), ([1.0], -1), ([1.0], 100.5)])
def test_percentile_rejects_bad_input(values, q):
    with pytest.raises(ValueError):
        percentile(values, q)


def test_latency_summary():
    summary = LatencySummary.of([0.1 * i for i in range(1, 11)])
    assert summary.count == 10
    assert summary.mean_s == pytest.approx(0.55)
    assert summary.p50_s == pytest.approx(0.55)
    assert summary.p90_s == pytest.approx(0.91)
    assert summary.max_s == pytest.approx(1.0)
    empty = LatencySummary.of([])
    assert empty.count == 0 and math.isnan(empty.p50_s)


def test_paired_differences():
    assert paired_differences([3.0, 5.0], [1.0, 4.0]) == [2.0, 1.0]
    with pytest.raises(ValueError):
        paired_differences([1.0], [1.0, 2.0])


def test_format_ms_and_table():
    assert format_ms(0.0123) == "12.30 ms"
    assert format_ms(0.5, 0) == "500 ms"
    assert format_ms(float("nan")) == "—"
    table = format_table(["a", "b"], [["1", "2"], ["3", "4"]])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1 | 2 |", "| 3 | 4 |"]
    with pytest.raises(ValueError):
        format_table(["a", "b"], [["1"]])


DOC = """# Benchmarks

## Engine

engine text

## Router overhead

old router text

## KV transfer

kv text
"""


def test_replace_section_keeps_other_sections():
    out = replace_section(DOC, "## Router overhead", "new router text")
    assert "old router text" not in out
    assert "new router text" in out
    assert out.index("## Engine") < out.index("new router text") < out.index("## KV transfer")
    assert "engine text" in out and "kv text" in out
    # Idempotent: the same body again changes nothing.
    assert replace_section(out, "## Router overhead", "new router text") == out


def test_replace_section_appends_or_starts_a_document():
    out = replace_section(DOC, "## SLO admission under overload", "slo text")
    assert out.rstrip().endswith("slo text")
    assert "kv text" in out
    fresh = replace_section("", "## Router overhead", "body")
    assert fresh.startswith("# Benchmarks\n")
    with pytest.raises(ValueError):
        replace_section(DOC, "Router overhead", "body")


@dataclass(frozen=True)
class _Sample:
    value: float
    values: tuple[float, ...]


def test_write_json_turns_nan_into_null(tmp_path):
    path = tmp_path / "out" / "r.json"
    write_json(path, {"sample": _Sample(float("nan"), (1.0, float("inf")))})
    assert json.loads(path.read_text()) == {"sample": {"value": None, "values": [1.0, None]}}


def test_process_cpu_s_reads_proc():
    if not os.path.exists(f"/proc/{os.getpid()}/stat"):
        pytest.skip("no /proc")
    assert process_cpu_s(os.getpid()) >= 0.0
    assert process_cpu_s(2**22 + 7) is None  # above Linux's largest pid_max


def test_distinct_prompts_share_no_prefix():
    prompts = distinct_prompts(5, 10, seed=3)
    assert len(set(prompts)) == 5
    assert all(p.startswith(f"3-{i}: ") for i, p in enumerate(prompts))
    assert all(len(p.split()) == 11 for p in prompts)
    assert distinct_prompts(5, 10, seed=3) == prompts


def test_stream_timing_properties():
    t = StreamTiming(start_s=10.0, first_token_s=10.25, end_s=11.0)
    assert t.ttft_s == pytest.approx(0.25)
    assert t.e2e_s == pytest.approx(1.0)
    assert StreamTiming(start_s=1.0, first_token_s=None, end_s=2.0).ttft_s is None


def test_parse_args_quick():
    args = parse_args(["--quick", "--concurrency", "8"])
    assert args.requests == 20 and args.concurrency == [8]


def _summary(p50: float, p99: float) -> LatencySummary:
    return LatencySummary(100, p50, p50, p99, p99, p99)


def _closed_loop(concurrency: int, rps: float, router_cpu: float) -> ClosedLoopResult:
    return ClosedLoopResult(
        concurrency=concurrency,
        duration_s=10.0,
        num_completed=int(rps * 10),
        errors={},
        requests_per_s=rps,
        latency=_summary(0.05, 0.1),
        ttft=_summary(0.04, 0.08),
        cpu_utilization={"router": router_cpu, "fake workers": 0.4, "load generator": 0.3},
    )


def _report(router_cpu: float) -> RouterBenchReport:
    overhead = OverheadResult(
        num_requests=200,
        num_prompt_tokens=45,
        max_tokens=4,
        router_e2e=_summary(0.030, 0.040),
        direct_e2e=_summary(0.026, 0.032),
        router_ttft=_summary(0.012, 0.018),
        direct_ttft=_summary(0.009, 0.011),
        added_e2e=_summary(0.004, 0.012),
        added_ttft=_summary(0.003, 0.007),
        outputs_match=True,
    )
    machine = MachineFacts("CPU", 2, "3.11", "1.85", "2.60", "2026-01-01 00:00 UTC", (1, 1, 1))
    return RouterBenchReport(
        command="python -m bench.router_bench",
        wall_s=60.0,
        machine=machine,
        load_average_end=(2.0, 1.5, 1.0),
        overhead=overhead,
        setup=ThroughputSetup((0,), (1,), pinned=True),
        throughput=(_closed_loop(16, 250.0, router_cpu), _closed_loop(64, 300.0, router_cpu)),
    )


def test_render_section_has_both_tables():
    text = render_section(_report(router_cpu=0.99))
    assert "### Added latency per request" in text
    assert "### Router throughput with instant fake workers" in text
    assert "| TTFT | 12.00 ms | 18.00 ms | 9.00 ms | 11.00 ms | 3.00 ms | 7.00 ms |" in text
    assert "| 64 | 300 | 50.00 ms | 100.00 ms | 40.00 ms | 99% | 40% | 30% | 0 |" in text
    assert "same greedy tokens" in text


def test_throughput_reading_says_whether_the_router_was_the_limit():
    setup = ThroughputSetup((0,), (1,), pinned=True)
    busy = throughput_reading(_report(0.99).throughput, setup)
    assert "router's own limit" in busy
    idle = throughput_reading(_report(0.5).throughput, setup)
    assert "only 50%" in idle and "600" in idle  # 300 req/s at half a core
