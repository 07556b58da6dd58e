"""Tables of load generator summaries: plain text for a terminal, markdown for docs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.bench.loadgen.metrics import Distribution, RunSummary
from tandem.bench.report import render_table


@dataclass(frozen=True)
class SweepPoint:
    """One load level of a sweep and what it measured."""

    summary: RunSummary
    # Closed loop: requests in flight; open loop: offered requests per second.
    concurrency: int | None = None
    rate_rps: float | None = None

    @property
    def load_label(self) -> str:
        if self.concurrency is not None:
            return f"c={self.concurrency}"
        return f"{self.rate_rps:g} req/s"


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.1f}"


def _num(value: float, fmt: str = ".2f") -> str:
    return "-" if math.isnan(value) else format(value, fmt)


def _pct(fraction: float) -> str:
    return "-" if math.isnan(fraction) else f"{fraction * 100:.1f}%"


def format_summary(summary: RunSummary, title: str = "", markdown: bool = False) -> str:
    """Counts and rates, then one row per latency metric (mean and percentiles)."""
    slo = summary.slo
    targets = ", ".join(
        f"{name} ≤ {_ms(value)} ms"
        for name, value in (
            ("TTFT", slo.ttft_s),
            ("long-document TTFT", slo.long_ttft_s),
            ("TPOT", slo.itl_s),
        )
        if value is not None
    )
    facts = [
        ("requests", f"{summary.num_succeeded} ok, {summary.num_failed} failed"),
        ("duration", f"{summary.duration_s:.2f} s"),
        (
            "throughput",
            f"{summary.request_throughput_rps:.2f} req/s, "
            f"{summary.output_throughput_tps:.1f} output tok/s",
        ),
        ("tokens", f"{summary.total_input_tokens} in, {summary.total_output_tokens} out"),
        (
            "SLO",
            f"{targets or 'no targets'}: {_pct(summary.slo_attainment)} attained, "
            f"goodput {_num(summary.goodput_rps)} req/s",
        ),
    ]
    if summary.errors:
        facts.append(("errors", ", ".join(f"{k} ×{v}" for k, v in summary.errors.items())))
    rows = [
        [name, *(_ms(v) for v in (d.mean, d.p50, d.p90, d.p99, d.max)), str(d.count)]
        for name, d in _distributions(summary)
    ]
    table = render_table(["ms", "mean", "p50", "p90", "p99", "max", "n"], rows, markdown)
    head = [f"## {title}" if markdown else title] if title else []
    bullet = "- " if markdown else ""
    return "\n".join([*head, *(f"{bullet}{k}: {v}" for k, v in facts), "", table])


def _distributions(summary: RunSummary) -> list[tuple[str, Distribution]]:
    return [
        ("TTFT", summary.ttft_s),
        ("ITL", summary.itl_s),
        ("TPOT", summary.tpot_s),
        ("E2E", summary.e2e_s),
    ]


def format_sweep(points: Sequence[SweepPoint], markdown: bool = False) -> str:
    """One row per load level: throughput, TTFT/ITL percentiles, SLO attainment, goodput."""
    header = "load|req/s|out tok/s|TTFT p50|TTFT p99|ITL p50|ITL p99|TPOT p50|SLO|goodput|failed"
    rows = []
    for point in points:
        s = point.summary
        rows.append(
            [
                point.load_label,
                _num(s.request_throughput_rps),
                _num(s.output_throughput_tps, ".1f"),
                _ms(s.ttft_s.p50),
                _ms(s.ttft_s.p99),
                _ms(s.itl_s.p50),
                _ms(s.itl_s.p99),
                _ms(s.tpot_s.p50),
                _pct(s.slo_attainment),
                _num(s.goodput_rps),
                str(s.num_failed),
            ]
        )
    return render_table(header.split("|"), rows, markdown)
