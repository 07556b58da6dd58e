"""Experiment 3 (and the goodput half of 4): goodput on a mixed workload."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tandem.bench.experiments.setup import ExperimentSetup, series, workload
from tandem.bench.loadgen.load import LoadConfig
from tandem.bench.loadgen.metrics import SloTargets
from tandem.bench.loadgen.plots import plot_goodput
from tandem.bench.loadgen.runner import BenchResult, WorkloadConfig
from tandem.bench.loadgen.tables import SweepPoint, crossing_rate, format_sweep
from tandem.bench.report import render_table

# The SLO attainment a rate must reach to count as sustained (DistServe's 90%).
ATTAINMENT_TARGET = 0.9


@dataclass(frozen=True)
class GoodputPlan:
    chat_input_len: int = 192  # chat part: log-normal lengths with these means
    chat_output_len: int = 64
    # Long documents: this share of requests, prompt ≈ long_input_len ± 25%.
    long_fraction: float = 0.1
    long_input_len: int = 1536
    long_output_len: int = 16
    rates: tuple[float, ...] = (0.2, 0.3, 0.4, 0.5, 0.6)
    num_requests: int = 24
    # The plot's title repeats these targets.
    slo: SloTargets = field(default_factory=lambda: SloTargets(2.0, 0.25, long_ttft_s=12.0))

    def workload(self, seed: int) -> WorkloadConfig:
        long = {"long_fraction": self.long_fraction, "long_input_len": self.long_input_len,
                "long_output_len": self.long_output_len}  # fmt: skip
        return workload("mixed", self.chat_input_len, self.chat_output_len, seed, **long)

    def loads(self, seed: int) -> list[LoadConfig]:
        return [
            LoadConfig(rate_rps=r, num_requests=self.num_requests, seed=seed, timeout_s=900)
            for r in self.rates
        ]


def plan_for(setup: ExperimentSetup) -> GoodputPlan:
    return GoodputPlan(rates=(0.3, 0.6), num_requests=12) if setup.quick else GoodputPlan()


def highest_rate_meeting(points: Sequence[SweepPoint], target: float = ATTAINMENT_TARGET) -> float:
    """The highest swept rate whose attainment is ≥ `target` (0 when none is)."""
    rates = [p.rate_rps or 0.0 for p in points if p.summary.slo_attainment >= target]
    return max(rates, default=0.0)


def sustained_rate(points: Sequence[SweepPoint], target: float = ATTAINMENT_TARGET) -> float:
    """Where attainment first falls below `target`, interpolated linearly between the
    last rate that met it and the first that did not (the highest swept rate when all
    meet it; 0 when the lowest rate already misses)."""
    return crossing_rate([(p.rate_rps or 0.0, p.summary.slo_attainment) for p in points], target)


def plot(results: Mapping[str, Sequence[BenchResult]], path: str) -> None:
    title = "goodput, mixed workload (TTFT ≤ 2 s, documents ≤ 12 s, TPOT ≤ 250 ms)"
    plot_goodput(series(results), path, title=title)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b > 0 else "∞" if a > 0 else "-"


def summary_rows(points: Mapping[str, Sequence[SweepPoint]]) -> list[list[str]]:
    return [
        [label, f"{highest_rate_meeting(runs):g}", f"{sustained_rate(runs):.2f}"]
        for label, runs in points.items()
    ]


def ratio_rows(points: Mapping[str, Sequence[SweepPoint]]) -> list[list[str]]:
    """Every pair (a ÷ b) of systems' sustained rates, Tandem layouts first."""
    labels = list(points)
    rates = {label: sustained_rate(points[label]) for label in labels}
    return [
        [f"{a} ÷ {b}", _ratio(rates[a], rates[b])]
        for i, a in enumerate(labels)
        for b in labels[i + 1 :]
    ]


def render(results: Mapping[str, Sequence[BenchResult]], image: str) -> str:
    """The plot, the sustained rates and their ratios, one table per system (the method
    is hand-written in the doc)."""
    points = series(results)
    header = ["system", "highest swept rate ≥ 90%", "90% crossing (interpolated)"]
    blocks = [
        f"![goodput]({image})",
        "Sustained rate (≥ 90% of requests within SLO):",
        render_table(header, summary_rows(points)),
        render_table(["ratio", "sustained rate"], ratio_rows(points)),
    ]
    for label, runs in points.items():
        blocks.append(f"**{label}**\n\n{format_sweep(runs, markdown=True)}")
    return "\n\n".join(blocks)
