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


def crossing_rate(points: Sequence[tuple[float, float]], target: float) -> float:
    """Where attainment first falls below `target` over (rate, attainment) points,
    interpolated linearly between the last rate that met it and the first that did not
    (the highest rate when all meet it; 0 when the lowest already misses; NaN misses)."""
    last_rate, last_attainment = 0.0, math.nan
    for rate, attainment in sorted(points):
        if not attainment >= target:
            if math.isnan(last_attainment):
                return 0.0
            fraction = (last_attainment - target) / (last_attainment - attainment)
            return last_rate + fraction * (rate - last_rate)
        last_rate, last_attainment = rate, attainment
    return last_rate


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.1f}"


def _num(value: float, fmt: str = ".2f") -> str:
    return "-" if math.isnan(value) else format(value, fmt)


def _pct(fraction: float) -> str:
    return "-" if math.isnan(fraction) else f"{fraction * 100:.1f}%"


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
