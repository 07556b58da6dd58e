"""The planner's question: which split of N workers serves the most requests within SLO?

For every layout (each split p + d = N with p, d >= 1, and N colocated workers) the
search finds the highest arrival rate at which at least `target` (90%) of the
requests meet both SLOs: it doubles the rate until a run misses (never past the
layout's steady-state throughput, see `capacity`), then bisects (in log space) to
`rel_tol`. That rate is the layout's goodput. The recommendation is
the split with the highest goodput (near-ties go to the lower p90 latencies), with
a one-line reason naming the runner-up, the colocated baseline and what limits it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.planner.capacity import throughput_bound
from tandem.planner.profile_model import LatencyLaws
from tandem.planner.simulator import ClusterSimulation, Layout, SimReport, SimSettings, SloTargets
from tandem.planner.workload import PlanWorkload

TARGET_ATTAINMENT = 0.9
_MAX_DOUBLINGS = 24
_MAX_BISECTIONS = 12


@dataclass(frozen=True)
class LayoutResult:
    layout: Layout
    # Highest rate (requests/s) with attainment >= target; 0 when none was found.
    goodput_rps: float
    # The run at that rate (at the lowest rate tried when none met the target).
    report: SimReport
    # The lowest rate tried that missed the target (what limits the layout), if any.
    above: SimReport | None = None
    # Set when the steady-state throughput of a pool capped the goodput ("decode pool's").
    throughput_limit: str = ""

    @property
    def ttft_p50_s(self) -> float:
        return self.report.percentile(self.report.ttft_s, 0.5)

    @property
    def ttft_p90_s(self) -> float:
        return self.report.percentile(self.report.ttft_s, 0.9)

    @property
    def tpot_p50_s(self) -> float:
        return self.report.percentile(self.report.tpot_s, 0.5)

    @property
    def tpot_p90_s(self) -> float:
        return self.report.percentile(self.report.tpot_s, 0.9)

    def to_json(self) -> dict[str, Any]:
        layout = self.layout
        row: dict[str, Any] = (
            {"colocated": layout.num_colocated}
            if layout.num_colocated
            else {"prefill": layout.num_prefill, "decode": layout.num_decode}
        )
        row.update(
            goodput_rps=round(self.goodput_rps, 4),
            ttft_p90_s=_finite(self.ttft_p90_s),
            tpot_p90_s=_finite(self.tpot_p90_s),
            attainment=round(self.report.attainment, 4),
        )
        return row


@dataclass(frozen=True)
class Plan:
    splits: list[LayoutResult]
    colocated: LayoutResult
    recommended: LayoutResult
    reason: str

    def to_json(self) -> dict[str, Any]:
        best = self.recommended.layout
        return {
            "recommended": {"prefill": best.num_prefill, "decode": best.num_decode},
            "splits": [s.to_json() for s in self.splits],
            "colocated": self.colocated.to_json(),
            "reason": self.reason,
        }


def _finite(value: float) -> float | None:
    return round(value, 5) if math.isfinite(value) else None


def alone_s(laws: LatencyLaws, workload: PlanWorkload) -> float:
    """Latency of a mean request alone on an idle worker."""
    isl, osl = workload.mean_prompt_tokens, workload.mean_output_tokens
    return laws.prefill_s(round(isl)) + osl * laws.decode_s(1, round(isl + osl / 2))


def first_guess_rps(laws: LatencyLaws, workload: PlanWorkload, num_workers: int) -> float:
    """A rate to start from: every worker serving one request at a time, alone."""
    return num_workers / max(alone_s(laws, workload), 1e-6)


def num_requests_at(
    rate_rps: float, horizon_s: float, workload: PlanWorkload, max_factor: int = 8
) -> int:
    """Requests a run at `rate_rps` simulates: enough arrivals to span `horizon_s` (a
    finite burst that fits in the batches would pass at any rate), at least the
    workload's own, at most `max_factor` times that."""
    size = len(workload.requests)
    return int(min(size * max_factor, max(size, math.ceil(rate_rps * horizon_s))))


def max_goodput(
    laws: LatencyLaws,
    settings: SimSettings,
    layout: Layout,
    slo: SloTargets,
    workload: PlanWorkload,
    *,
    target: float = TARGET_ATTAINMENT,
    rel_tol: float = 0.03,
) -> LayoutResult:
    """The highest rate at which `layout` keeps `target` of requests within the SLOs."""

    # Arrivals must outlast several request lifetimes for a rate to count as sustained.
    horizon_s = max(10 * slo.ttft_s, 4 * alone_s(laws, workload))

    def run(rate: float) -> SimReport:
        count = num_requests_at(rate, horizon_s, workload)
        return ClusterSimulation(laws, settings, layout, slo).run(workload, rate, target, count)

    # Past the pools' steady-state throughput no rate is sustained, whatever a finite run
    # shows (see `capacity`).
    bound, pool = throughput_bound(
        laws, settings.limits, layout, workload, settings.max_local_prefill_tokens
    )
    rate = min(first_guess_rps(laws, workload, layout.num_workers), bound)
    good: SimReport | None = None
    bad: SimReport | None = None
    for _ in range(_MAX_DOUBLINGS):
        report = run(rate)
        if report.attainment >= target and not report.stopped_early:
            good = report
            if bad is not None or rate >= bound:
                break
            rate = min(2 * rate, bound)
        else:
            bad = report
            if good is not None:
                break
            rate /= 2
    if good is None:
        assert bad is not None
        return LayoutResult(layout, 0.0, _full(laws, settings, layout, slo, workload, bad), bad)
    if bad is None:
        capped = pool if good.rate_rps >= bound * (1 - 1e-9) else ""
        return LayoutResult(layout, good.rate_rps, good, throughput_limit=capped)
    for _ in range(_MAX_BISECTIONS):
        if bad.rate_rps / good.rate_rps <= 1 + rel_tol:
            break
        report = run(math.sqrt(good.rate_rps * bad.rate_rps))
        if report.attainment >= target and not report.stopped_early:
            good = report
        else:
            bad = report
    return LayoutResult(layout, good.rate_rps, good, bad)


def _full(
    laws: LatencyLaws,
    settings: SimSettings,
    layout: Layout,
    slo: SloTargets,
    workload: PlanWorkload,
    report: SimReport,
) -> SimReport:
    """The same run without stopping early (its percentiles describe all requests)."""
    if not report.stopped_early:
        return report
    sim = ClusterSimulation(laws, settings, layout, slo)
    return sim.run(workload, report.rate_rps, num_requests=report.num_requests)


def layouts(num_workers: int, max_per_role: int | None = None) -> tuple[list[Layout], Layout]:
    """Every split p + d = N (p, d >= 1; each at most `max_per_role`, the most workers
    the pools take of one role) and the colocated layout of N workers."""
    if num_workers < 2:
        raise ValueError(f"the budget must be >= 2 workers (one per role), got {num_workers}")
    cap = num_workers if max_per_role is None else max_per_role
    splits = [Layout(p, num_workers - p) for p in range(1, num_workers)
              if p <= cap and num_workers - p <= cap]  # fmt: skip
    if not splits:
        raise ValueError(
            f"the budget of {num_workers} workers has no split with at most {cap} per role"
        )
    return splits, Layout(num_colocated=num_workers)


def plan(
    laws: LatencyLaws,
    settings: SimSettings,
    num_workers: int,
    slo: SloTargets,
    workload: PlanWorkload,
    *,
    target: float = TARGET_ATTAINMENT,
    progress: Callable[[LayoutResult], None] | None = None,
    max_per_role: int | None = None,
) -> Plan:
    """Search every layout of `num_workers` (splits with at most `max_per_role` of a
    role) and recommend a split."""
    split_layouts, colocated_layout = layouts(num_workers, max_per_role)
    results = []
    for layout in [*split_layouts, colocated_layout]:
        result = max_goodput(laws, settings, layout, slo, workload, target=target)
        results.append(result)
        if progress is not None:
            progress(result)
    splits, colocated = results[:-1], results[-1]
    best = recommend(splits)
    return Plan(splits, colocated, best, reason(best, splits, colocated, workload, target))


def recommend(splits: list[LayoutResult], tie_tol: float = 0.03) -> LayoutResult:
    """The split with the most goodput; within `tie_tol` of it, the lowest p90 latencies."""
    top = max(s.goodput_rps for s in splits)
    near = [s for s in splits if s.goodput_rps >= top * (1 - tie_tol)]

    def latency(s: LayoutResult) -> float:
        ttft, tpot = s.ttft_p90_s, s.tpot_p90_s
        return (ttft if math.isfinite(ttft) else math.inf) + (
            tpot if math.isfinite(tpot) else math.inf
        )

    return min(near, key=latency)


def reason(
    best: LayoutResult,
    splits: list[LayoutResult],
    colocated: LayoutResult,
    workload: PlanWorkload,
    target: float,
) -> str:
    """One line: what the recommendation sustains and against what."""
    if best.goodput_rps <= 0:
        return (f"no layout keeps {target:.0%} of requests within the SLOs even at a trickle: "
                "the SLOs are tighter than one request alone takes on this hardware")  # fmt: skip
    others = sorted((s for s in splits if s is not best), key=lambda s: -s.goodput_rps)
    line = (
        f"{best.layout.label} sustains {best.goodput_rps:.3g} req/s with >= {target:.0%} "
        f"within SLO (prompts ~{workload.mean_prompt_tokens:.0f} tokens, outputs "
        f"~{workload.mean_output_tokens:.0f})"
    )
    if others:
        line += f", {_gain(best, others[0])} vs {others[0].layout.label}"
    line += f"; {colocated.layout.label}: {colocated.goodput_rps:.3g} req/s"
    if colocated.goodput_rps > best.goodput_rps:
        line += f" ({_gain(colocated, best)}: colocated beats every split here)"
    return line + _limit(best)


def _gain(a: LayoutResult, b: LayoutResult) -> str:
    if b.goodput_rps <= 0:
        return "the only split that meets the SLOs"
    change = a.goodput_rps / b.goodput_rps - 1
    return f"{change:+.0%}" if abs(change) >= 0.005 else "a tie on goodput, lower latency"


def _limit(result: LayoutResult) -> str:
    if result.throughput_limit:
        return f"; capped by the {result.throughput_limit} throughput"
    report = result.above
    if report is None:
        return ""
    if report.num_ttft_missed > report.num_tpot_missed:
        return "; beyond it TTFT misses dominate (prefill-bound)"
    if report.num_tpot_missed > report.num_ttft_missed:
        return "; beyond it TPOT misses dominate (decode-bound)"
    return ""
