"""Plots of benchmark results, written to PNG (matplotlib `Figure`s rendered by Agg:
no pyplot, no display, no global figure state)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure

from tandem.bench.loadgen.tables import SweepPoint

Series = Mapping[str, Sequence[SweepPoint]]


def save_png(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def plot_frontier(series: Series, path: str | Path, title: str = "") -> Path:
    """Output tokens/s (x) against TTFT and ITL (y, p50 solid, p99 dashed)."""
    fig = Figure(figsize=(11, 4.2))
    axes = fig.subplots(1, 2)
    for (label, points), color in zip(series.items(), _colors(), strict=False):
        xs = [p.summary.output_throughput_tps for p in points]
        for ax, metric in zip(axes, ("ttft_s", "itl_s"), strict=True):
            p50 = [getattr(p.summary, metric).p50 * 1000 for p in points]
            p99 = [getattr(p.summary, metric).p99 * 1000 for p in points]
            ax.plot(xs, p50, "o-", color=color, label=f"{label} p50")
            ax.plot(xs, p99, "s--", color=color, alpha=0.7, label=f"{label} p99")
            for x, y, point in zip(xs, p50, points, strict=True):
                ax.annotate(
                    point.load_label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7
                )
    for ax, name in zip(axes, ("TTFT", "ITL"), strict=True):
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "throughput vs latency (concurrency sweep)")
    return save_png(fig, path)


def plot_goodput(series: Series, path: str | Path, title: str = "") -> Path:
    """Goodput (left) and SLO attainment (right) against the offered request rate."""
    fig = Figure(figsize=(11, 4.2))
    left, right = fig.subplots(1, 2)
    max_rate = 0.0
    for (label, points), color in zip(series.items(), _colors(), strict=False):
        rates = [p.rate_rps or 0.0 for p in points]
        max_rate = max([max_rate, *rates])
        left.plot(rates, [p.summary.goodput_rps for p in points], "o-", color=color, label=label)
        right.plot(
            rates, [p.summary.slo_attainment * 100 for p in points], "o-", color=color, label=label
        )
    left.plot([0, max_rate], [0, max_rate], color="gray", linestyle=":", label="offered")
    left.set_ylabel("goodput (req/s meeting the SLO)")
    right.set_ylabel("SLO attainment (%)")
    right.set_ylim(0, 105)
    for ax in (left, right):
        ax.set_xlabel("offered rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "goodput vs request rate")
    return save_png(fig, path)


def _colors() -> list[str]:  # matplotlib's default color cycle, by name
    return [f"C{i}" for i in range(10)]
