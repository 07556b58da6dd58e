"""Experiment 1 (and the frontier half of 4): the throughput/latency frontier."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tandem.bench.experiments.setup import ExperimentSetup, series, workload
from tandem.bench.loadgen.load import LoadConfig
from tandem.bench.loadgen.metrics import SloTargets
from tandem.bench.loadgen.plots import plot_frontier
from tandem.bench.loadgen.runner import BenchResult, WorkloadConfig
from tandem.bench.loadgen.tables import SweepPoint, format_sweep
from tandem.bench.report import render_table

SYSTEMS = ("disaggregated", "colocated-2", "colocated-1", "transformers")


@dataclass(frozen=True)
class FrontierPlan:
    input_len: int = 128
    output_len: int = 64
    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16)
    min_requests: int = 8  # requests per level: enough that most of the run is at full concurrency
    requests_per_slot: int = 3
    slo: SloTargets = field(default_factory=SloTargets)

    def num_requests(self, concurrency: int) -> int:
        return max(self.min_requests, self.requests_per_slot * concurrency)

    def workload(self, seed: int) -> WorkloadConfig:
        return workload("fixed", self.input_len, self.output_len, seed)

    def loads(self, seed: int) -> list[LoadConfig]:
        return [
            LoadConfig(concurrency=c, num_requests=self.num_requests(c), seed=seed, timeout_s=900)
            for c in self.concurrencies
        ]


def plan_for(setup: ExperimentSetup) -> FrontierPlan:
    return FrontierPlan(concurrencies=(1, 4)) if setup.quick else FrontierPlan()


def plot(results: Mapping[str, Sequence[BenchResult]], path: str) -> None:
    plot_frontier(series(results), path, title="throughput vs latency, concurrency sweep")


def _ratio(numerator: float, denominator: float) -> str:
    if math.isnan(numerator) or math.isnan(denominator) or denominator == 0:
        return "-"
    return f"{numerator / denominator:.2f}×"


def peer_rows(points: Mapping[str, Sequence[SweepPoint]], peer_label: str) -> list[list[str]]:
    """Per concurrency: each Tandem layout's output tokens/s and p50 ITL ÷ the peer's."""
    peer = {p.concurrency: p.summary for p in points[peer_label]}
    rows = []
    for label, runs in points.items():
        if label == peer_label:
            continue
        for point in runs:
            other = peer.get(point.concurrency)
            if other is None:
                continue
            mine = point.summary
            rows.append(
                [
                    f"{label} · c={point.concurrency}",
                    _ratio(mine.output_throughput_tps, other.output_throughput_tps),
                    _ratio(mine.ttft_s.p50, other.ttft_s.p50),
                    _ratio(mine.itl_s.p50, other.itl_s.p50),
                    _ratio(mine.tpot_s.p50, other.tpot_s.p50),
                ]
            )
    return rows


def render(results: Mapping[str, Sequence[BenchResult]], image: str) -> str:
    """The plot, one table per system, the ratios to the peer (the method is hand-written)."""
    points = series(results)
    blocks = [f"![frontier]({image})"]
    for label, runs in points.items():
        blocks.append(f"**{label}**\n\n{format_sweep(runs, markdown=True)}")
    peer_label = next((label for label in points if label.startswith("transformers")), None)
    if peer_label:
        header = ["Tandem ÷ transformers serve", "out tok/s", "TTFT p50", "ITL p50", "TPOT p50"]
        blocks += [
            "Ratios at equal concurrency (throughput: higher is better; latencies: lower):",
            render_table(header, peer_rows(points, peer_label)),
        ]
    return "\n\n".join(blocks)
