"""The fidelity table: simulated / measured / error per metric and cell, and why a miss.

A row compares, for one layout and workload:
- goodput: the planner's (`tandem plan`'s search) against the measured one (where the
  swept attainment crosses 90%);
- TTFT / TPOT p50 and p90 at the measured operating point (the highest swept rate that
  met the target; the lowest one when none did), the simulator replaying the very
  requests that run sent.
Errors are (simulated - measured) / measured. A metric past its target (goodput 15%,
percentiles 25%) gets reasons drawn from what the run recorded (see `reasons`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tandem.bench.report import render_table

GOODPUT_TARGET = 0.15
LATENCY_TARGET = 0.25
METRICS = ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")
_LOCAL = "local_prefill"


@dataclass(frozen=True)
class Pair:
    sim: float
    measured: float

    @property
    def error(self) -> float:
        ok = math.isfinite(self.sim) and math.isfinite(self.measured) and self.measured > 0
        return (self.sim - self.measured) / self.measured if ok else math.nan


@dataclass(frozen=True)
class Row:
    layout: str
    workload: str
    goodput_rps: Pair
    # Goodput of the simulator replaying the swept runs (same requests, same cap).
    replay_goodput_rps: float
    # The same without the workers sharing cores (evidence for the contention model).
    replay_unshared_goodput_rps: float
    latency_rate_rps: float
    latencies: dict[str, Pair]
    latencies_unshared: dict[str, float]
    num_latency_requests: int
    # Share of placements prefilled on the decode worker, measured / simulated (disagg.).
    local_share: Pair
    num_cut: int
    load_avg_1m: float
    num_cores: int
    # Every swept rate: measured and simulated attainment, cuts, placements.
    rates: list[dict[str, Any]] = field(default_factory=list)
    # "" when the sweep bracketed the measured goodput; ">" when every swept rate met the
    # target (goodput above the highest), "<" when none did (below the lowest).
    goodput_bound: str = ""
    # Cores the router and the load generator kept busy at the operating point.
    overhead_cores: float = math.nan


def _err(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:+.0%}"


def _num(value: float, digits: str) -> str:
    """A value, or "-" where there is none (e.g. no simulated request finished)."""
    return f"{value:{digits}}" if math.isfinite(value) else "-"


def _cell(pair: Pair, unit: str, digits: str = ".3g") -> str:
    sim, measured = _num(pair.sim, digits), _num(pair.measured, digits)
    return f"{sim} / {measured}{unit} ({_err(pair.error)})"


def misses(row: Row) -> list[str]:
    """The metrics past their targets."""
    bad = row.goodput_bound or not abs(row.goodput_rps.error) <= GOODPUT_TARGET
    out = ["goodput"] if bad else []
    return out + [m for m in METRICS if not abs(row.latencies[m].error) <= LATENCY_TARGET]


def reasons(row: Row) -> str:
    """Why the misses, from what the run recorded; '' when every metric is on target."""
    missed = misses(row)
    if not missed:
        return ""
    out: list[str] = []
    measured = row.goodput_rps.measured
    if row.goodput_bound:
        side = "every" if row.goodput_bound == ">" else "no"
        out.append(f"{side} swept rate met the target: the sweep did not bracket the "
                   f"goodput in {len(row.rates)} runs")  # fmt: skip
    if "goodput" in missed:
        replay = Pair(row.replay_goodput_rps, measured)
        if abs(replay.error) <= GOODPUT_TARGET:
            out.append(f"replaying the swept runs gives {replay.sim:.3g} req/s "
                       f"({_err(replay.error)}): the planner's search, not the model")  # fmt: skip
        unshared = Pair(row.replay_unshared_goodput_rps, measured)
        if abs(unshared.error) < abs(replay.error):
            out.append(f"without core sharing the replay gives {unshared.sim:.3g} req/s "
                       f"({_err(unshared.error)}): the contention model overstates it")  # fmt: skip
    latency_misses = [m for m in missed if m != "goodput"]
    closer = [m for m in latency_misses
              if abs(Pair(row.latencies_unshared[m], row.latencies[m].measured).error)
              < abs(row.latencies[m].error)]  # fmt: skip
    if closer:
        out.append("closer without core sharing: " + ", ".join(
            f"{_label(m)} {_err(Pair(row.latencies_unshared[m], row.latencies[m].measured).error)}"
            for m in closer))  # fmt: skip
    local = row.local_share
    if math.isfinite(local.sim) and abs(local.sim - local.measured) > 0.15:
        out.append(
            f"the router prefilled {local.measured:.0%} on the decode worker, the simulated "
            f"router {local.sim:.0%} (its models vs the profile's laws)"
        )
    if row.overhead_cores >= 0.2:
        out.append(f"the router and the load generator kept {row.overhead_cores:.2f} of the "
                   f"{row.num_cores} cores busy (not simulated)")  # fmt: skip
    if row.num_cut:
        out.append(f"{row.num_cut} requests cut at the cap over the sweep")
    if row.load_avg_1m > row.num_cores + 1:
        out.append(f"machine busy (load {row.load_avg_1m:.1f} on {row.num_cores} cores)")
    if any(m.endswith("p90_s") for m in latency_misses) and row.num_latency_requests < 40:
        out.append(f"p90 of {row.num_latency_requests} requests")
    if not out:
        out.append("not explained by what the run records: the router's and the load "
                   "generator's CPU time and the gRPC hops are not simulated")  # fmt: skip
    return "; ".join(out)


def _label(metric: str) -> str:
    name, q, _ = metric.split("_")
    return f"{name.upper()} {q}"


def _goodput_cell(row: Row) -> str:
    if not row.goodput_bound:
        return _cell(row.goodput_rps, "")
    pair = row.goodput_rps
    return f"{pair.sim:.3g} / {row.goodput_bound} {pair.measured:.3g} (-)"


def render(rows: list[Row]) -> str:
    header = ["layout", "workload", "goodput req/s sim / meas (err)", "at req/s",
              "TTFT p50 s", "TTFT p90 s", "TPOT p50 ms", "TPOT p90 ms", "why (misses)"]  # fmt: skip
    body = []
    for r in rows:
        lat = r.latencies
        tpot = {m: Pair(lat[m].sim * 1e3, lat[m].measured * 1e3) for m in METRICS[2:]}
        body.append([
            r.layout, r.workload, _goodput_cell(r), f"{r.latency_rate_rps:.3g}",
            _cell(lat["ttft_p50_s"], ""), _cell(lat["ttft_p90_s"], ""),
            _cell(tpot["tpot_p50_s"], "", ".0f"), _cell(tpot["tpot_p90_s"], "", ".0f"),
            reasons(r) or "on target",
        ])  # fmt: skip
    return render_table(header, body)


def summary_line(rows: list[Row]) -> str:
    """How many cells and metrics met their targets."""
    total = len(rows) * (1 + len(METRICS))
    missed = sum(len(misses(r)) for r in rows)
    goodput = sum("goodput" not in misses(r) for r in rows)
    return (f"{total - missed} of {total} values on target; goodput within "
            f"{GOODPUT_TARGET:.0%} in {goodput} of {len(rows)} cells.")  # fmt: skip
