"""Tables of load generator summaries: plain text for a terminal, markdown for docs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.bench.loadgen.metrics import RunSummary
from tandem.bench.report import render_table


@dataclass(frozen=True)
class SweepPoint:
    """One load level of a sweep and what it measured."""

    summary: RunSummary
    concurrency: int | None = None  # closed loop: requests in flight
    rate_rps: float | None = None  # open loop: offered requests per second

    @property
    def load_label(self) -> str:
        closed_loop = self.concurrency is not None
        return f"c={self.concurrency}" if closed_loop else f"{self.rate_rps:g} req/s"


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.1f}"


def _num(value: float, fmt: str = ".2f") -> str:
    return "-" if math.isnan(value) else format(value, fmt)


def _pct(fraction: float) -> str:
    return "-" if math.isnan(fraction) else f"{fraction * 100:.1f}%"


def format_summary(summary: RunSummary, title: str = "", markdown: bool = False) -> str:
    """Counts and rates, then one row per latency metric (mean and percentiles)."""
    slo = summary.slo
    named = (("TTFT", slo.ttft_s), ("long-document TTFT", slo.long_ttft_s), ("TPOT", slo.itl_s))
    targets = ", ".join(f"{name} ≤ {_ms(value)} ms" for name, value in named if value is not None)
    facts = [
        ("requests", f"{summary.num_succeeded} ok, {summary.num_failed} failed"),
        ("duration", f"{summary.duration_s:.2f} s"),
        ("throughput", f"{summary.request_throughput_rps:.2f} req/s, "
                       f"{summary.output_throughput_tps:.1f} output tok/s"),
        ("tokens", f"{summary.total_input_tokens} in, {summary.total_output_tokens} out"),
        ("SLO", f"{targets or 'no targets'}: {_pct(summary.slo_attainment)} attained, "
                f"goodput {_num(summary.goodput_rps)} req/s"),
    ]  # fmt: skip
    if summary.errors:
        facts.append(("errors", ", ".join(f"{k} ×{v}" for k, v in summary.errors.items())))
    metrics = {"TTFT": summary.ttft_s, "ITL": summary.itl_s, "TPOT": summary.tpot_s,
               "E2E": summary.e2e_s}  # fmt: skip
    rows = [
        [name, *(_ms(v) for v in (d.mean, d.p50, d.p90, d.p99, d.max)), str(d.count)]
        for name, d in metrics.items()
    ]
    table = render_table(["ms", "mean", "p50", "p90", "p99", "max", "n"], rows, markdown)
    head = [f"## {title}" if markdown else title] if title else []
    bullet = "- " if markdown else ""
    return "\n".join([*head, *(f"{bullet}{k}: {v}" for k, v in facts), "", table])


def format_sweep(points: Sequence[SweepPoint], markdown: bool = False) -> str:
    """One row per load level: throughput, TTFT/ITL percentiles, SLO attainment, goodput."""
    header = "load|req/s|out tok/s|TTFT p50|TTFT p99|ITL p50|ITL p99|TPOT p50|SLO|goodput|failed"
    rows = [_sweep_row(point) for point in points]
    return render_table(header.split("|"), rows, markdown)


def _sweep_row(point: SweepPoint) -> list[str]:
    s = point.summary
    latencies = (s.ttft_s.p50, s.ttft_s.p99, s.itl_s.p50, s.itl_s.p99, s.tpot_s.p50)
    return [
        point.load_label, _num(s.request_throughput_rps), _num(s.output_throughput_tps, ".1f"),
        *map(_ms, latencies), _pct(s.slo_attainment), _num(s.goodput_rps), str(s.num_failed),
    ]  # fmt: skip
