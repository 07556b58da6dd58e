"""`tandem plan --plot`: goodput per split as a bar chart, the colocated baseline as a line.

Rendered by matplotlib's Agg backend into a PNG (no pyplot, no display needed).
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from tandem.planner.search import Plan


def plot_plan(result: Plan, path: str | Path, title: str = "") -> Path:
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    labels = [s.layout.label for s in result.splits]
    goodput = [s.goodput_rps for s in result.splits]
    colors = ["tab:green" if s is result.recommended else "tab:blue" for s in result.splits]
    bars = ax.bar(labels, goodput, color=colors)
    for bar, split in zip(bars, result.splits, strict=True):
        ax.annotate(
            f"{split.goodput_rps:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center", va="bottom", fontsize=8,
        )  # fmt: skip
    ax.axhline(
        result.colocated.goodput_rps, color="tab:red", linestyle="--",
        label=f"{result.colocated.layout.label}: {result.colocated.goodput_rps:.3g} req/s",
    )  # fmt: skip
    ax.set_xlabel("split (prefill + decode workers)")
    ax.set_ylabel("goodput (req/s with >= 90% within SLO)")
    ax.set_title(title or "goodput per split")
    ax.legend(fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
