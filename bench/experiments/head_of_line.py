"""Experiment 2: head-of-line blocking."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from matplotlib.figure import Figure

from tandem.bench.experiments.setup import ExperimentSetup, bench_config, workload
from tandem.bench.loadgen.clients import ClientConfig
from tandem.bench.loadgen.load import LoadConfig
from tandem.bench.loadgen.metrics import percentile, ttft_s
from tandem.bench.loadgen.plots import save_png
from tandem.bench.loadgen.runner import BenchConfig, BenchResult, LongPromptConfig, run_benchmark
from tandem.bench.loadgen.traces import RequestTrace
from tandem.bench.loadgen.workloads import LONG_TAG
from tandem.bench.report import render_table

SYSTEMS = (
    "colocated-1-no-chunking", "colocated-1", "disaggregated", "disaggregated-remote-prefill",
)  # fmt: skip
# Gaps in the first seconds (requests still ramping up) are not part of the baseline.
RAMP_S = 2.0
# After the long prompt's first token: the window in which its KV is imported and it
# joins the decode batch.
JOIN_WINDOW_S = 2.0


@dataclass(frozen=True)
class HeadOfLinePlan:
    short_input_len: int = 64
    short_output_len: int = 128
    concurrency: int = 8
    duration_s: float = 30.0
    inject_at_s: float = 12.0
    long_input_len: int = 2048
    long_output_len: int = 16

    def config(self, client: ClientConfig, seed: int) -> BenchConfig:
        short = workload("fixed", self.short_input_len, self.short_output_len, seed)
        load = LoadConfig(self.concurrency, duration_s=self.duration_s, seed=seed, timeout_s=600)
        long = LongPromptConfig((self.inject_at_s,), self.long_input_len, self.long_output_len)
        return bench_config(client, short, load, long_prompt=long)


def plan_for(setup: ExperimentSetup) -> HeadOfLinePlan:
    if setup.quick:
        return HeadOfLinePlan(duration_s=14.0, inject_at_s=6.0, long_input_len=1024)
    return HeadOfLinePlan()


@dataclass(frozen=True)
class HeadOfLineStats:
    """Inter-token gaps of the short requests, seconds, in windows around the long one."""

    long_prefill_s: float  # long prompt: sent → first token (its prefill, queueing included)
    baseline_p99_s: float  # gaps that ended before the long prompt was sent (after the ramp-up)
    baseline_count: int
    during_p99_s: float  # gaps overlapping [long sent, long first token]
    during_max_s: float
    during_count: int
    # Gaps overlapping [long first token, + JOIN_WINDOW_S]: KV import, joining the batch.
    join_p99_s: float
    join_max_s: float
    # TTFT of the short requests sent while the long prompt was being prefilled.
    arrivals_during: int = 0
    arrivals_ttft_max_s: float = math.nan

    @property
    def during_over_baseline(self) -> float:
        return self.during_p99_s / self.baseline_p99_s if self.baseline_p99_s > 0 else math.nan


def _gaps(traces: Sequence[RequestTrace]) -> list[tuple[float, float]]:
    """(start, end) of every inter-token gap of the successful short requests."""
    return [
        pair
        for trace in traces
        if trace.tag != LONG_TAG and trace.ok
        for pair in itertools.pairwise(trace.token_times_s)
    ]


def head_of_line_stats(traces: Sequence[RequestTrace], ramp_s: float = RAMP_S) -> HeadOfLineStats:
    """The stats of one run whose traces share a time origin and hold one long request."""
    longs = [t for t in traces if t.tag == LONG_TAG]
    if len(longs) != 1 or ttft_s(longs[0]) is None:
        raise ValueError("need exactly one long request, and it must have produced a token")
    long = longs[0]
    sent, first = long.send_s, long.token_times_s[0]
    gaps = _gaps(traces)

    def lengths(start: float, end: float) -> list[float]:
        return [b - a for a, b in gaps if b > start and a < end]

    baseline = [b - a for a, b in gaps if a >= ramp_s and b <= sent]
    during = lengths(sent, first)
    join = lengths(first, first + JOIN_WINDOW_S)
    arrivals = [t for t in traces if t.tag != LONG_TAG and t.ok and sent <= t.send_s < first]
    arrival_ttfts = [v for t in arrivals if (v := ttft_s(t)) is not None]
    return HeadOfLineStats(
        first - sent, percentile(baseline, 99), len(baseline), percentile(during, 99),
        max(during, default=math.nan), len(during), percentile(join, 99),
        max(join, default=math.nan), len(arrivals), max(arrival_ttfts, default=math.nan),
    )  # fmt: skip


async def run_one(setup: ExperimentSetup, client: ClientConfig) -> BenchResult:
    return await run_benchmark(plan_for(setup).config(client, setup.seed))


def plot(results: Mapping[str, BenchResult], path: str) -> None:
    """One panel per layout, same axes: the short requests' gaps over time, the long
    prompt's prefill shaded."""
    fig = Figure(figsize=(11, 2.6 * len(results)))
    axes = fig.subplots(len(results), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    for ax, (label, result) in zip(axes, results.items(), strict=True):
        traces = result.load.traces
        gaps = _gaps(traces)
        ax.scatter([b for _, b in gaps], [(b - a) * 1000 for a, b in gaps], s=3, alpha=0.5)
        for long in (t for t in traces if t.tag == LONG_TAG):
            first = long.token_times_s[0] if long.token_times_s else long.end_s
            ax.axvspan(long.send_s, first, color="tab:red", alpha=0.15, label="long prefill")
            ax.axvline(long.end_s, color="tab:red", alpha=0.4, linestyle=":", label="long end")
        ax.set_yscale("log")
        ax.set_ylabel("gap (ms)")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    axes[-1].set_xlabel("time since start (s)")
    fig.suptitle("inter-token gaps of short requests around one long prompt")
    save_png(fig, path)


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.0f}"


def render(results: Mapping[str, BenchResult], image: str) -> str:
    """The plot and the table (the method is hand-written in the doc)."""
    rows = []
    for label, result in results.items():
        s = head_of_line_stats(result.load.traces)
        ttft = "-" if math.isnan(s.arrivals_ttft_max_s) else f"{s.arrivals_ttft_max_s:.2f}"
        rows.append(
            [label, f"{s.long_prefill_s:.2f}", _ms(s.baseline_p99_s), _ms(s.during_p99_s),
             _ms(s.during_max_s), f"{s.during_over_baseline:.2f}×", _ms(s.join_p99_s),
             _ms(s.join_max_s), str(s.arrivals_during), ttft]
        )  # fmt: skip
    header = (
        "layout|long prefill (s)|ITL p99 before (ms)|ITL p99 during (ms)|max during (ms)|"
        "during ÷ before|p99 join (ms)|max join (ms)|shorts sent during|their max TTFT (s)"
    )
    return f"![head-of-line]({image})\n\n{render_table(header.split('|'), rows)}"
