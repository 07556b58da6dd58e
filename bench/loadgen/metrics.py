"""Latency and throughput metrics: pure functions over `RequestTrace`s."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.bench.loadgen.traces import RequestTrace
from tandem.bench.loadgen.workloads import LONG_TAG
from tandem.bench.report import plain

PERCENTILES = (50.0, 90.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 ≤ q ≤ 100), linear interpolation; NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ttft_s(trace: RequestTrace) -> float | None:
    return trace.token_times_s[0] - trace.send_s if trace.token_times_s else None


def itl_gaps_s(trace: RequestTrace) -> list[float]:
    times = trace.token_times_s
    return [later - earlier for earlier, later in itertools.pairwise(times)]


def tpot_s(trace: RequestTrace) -> float | None:
    if trace.num_output_tokens < 2 or len(trace.token_times_s) < 2:
        return None
    return (trace.token_times_s[-1] - trace.token_times_s[0]) / (trace.num_output_tokens - 1)


def e2e_s(trace: RequestTrace) -> float:
    return trace.end_s - trace.send_s


@dataclass(frozen=True)
class SloTargets:
    """Latency targets, seconds; None = no target on that metric."""

    ttft_s: float | None = None
    itl_s: float | None = None  # checked against each request's TPOT (its mean inter-token latency)
    # TTFT target of requests tagged "long" (long documents); None = `ttft_s`.
    long_ttft_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "itl_s", "long_ttft_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")

    def ttft_target(self, tag: str) -> float | None:
        if tag == LONG_TAG and self.long_ttft_s is not None:
            return self.long_ttft_s
        return self.ttft_s


def meets_slo(trace: RequestTrace, slo: SloTargets) -> bool:
    if not trace.ok:
        return False
    ttft = ttft_s(trace)
    if ttft is None:  # succeeded without a token: nothing was served in time
        return False
    ttft_target = slo.ttft_target(trace.tag)
    if ttft_target is not None and ttft > ttft_target:
        return False
    tpot = tpot_s(trace)
    return slo.itl_s is None or tpot is None or tpot <= slo.itl_s


def slo_attainment(traces: Sequence[RequestTrace], slo: SloTargets) -> float:
    """Fraction of requests (failed ones included) meeting the SLO; NaN for none."""
    if not traces:
        return math.nan
    return sum(meets_slo(t, slo) for t in traces) / len(traces)


def goodput_rps(traces: Sequence[RequestTrace], slo: SloTargets, duration_s: float) -> float:
    """Requests meeting the SLO per second of a run that lasted `duration_s`."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    return sum(meets_slo(t, slo) for t in traces) / duration_s


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency metric, seconds (NaN when there were no samples)."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
        return cls(len(values), sum(values) / len(values), p50, p90, p99, max(values))


@dataclass(frozen=True)
class RunSummary:
    """Everything a run measured; `to_json()` is what the results file holds."""

    num_requests: int
    num_succeeded: int
    num_failed: int
    # Failed requests by the first part of their error ("HTTP 429", "UNAVAILABLE", ...).
    errors: dict[str, int]
    duration_s: float
    request_throughput_rps: float
    output_throughput_tps: float
    total_input_tokens: int
    total_output_tokens: int
    ttft_s: Distribution
    itl_s: Distribution
    tpot_s: Distribution
    e2e_s: Distribution
    slo: SloTargets = field(default_factory=SloTargets)
    slo_attainment: float = math.nan
    goodput_rps: float = math.nan

    def to_json(self) -> dict[str, Any]:
        return dict(plain(self))


def summarize(
    traces: Sequence[RequestTrace], duration_s: float, slo: SloTargets | None = None
) -> RunSummary:
    """Summary of `traces` from a run that lasted `duration_s` seconds."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    slo = slo or SloTargets()
    succeeded = [t for t in traces if t.ok]
    errors = Counter(t.error.split(":")[0] for t in traces if not t.ok)
    num_output = sum(t.num_output_tokens for t in succeeded)
    return RunSummary(
        num_requests=len(traces),
        num_succeeded=len(succeeded),
        num_failed=len(traces) - len(succeeded),
        errors=dict(sorted(errors.items())),
        duration_s=duration_s,
        request_throughput_rps=len(succeeded) / duration_s,
        output_throughput_tps=num_output / duration_s,
        total_input_tokens=sum(t.prompt_len for t in succeeded),
        total_output_tokens=num_output,
        ttft_s=Distribution.of([v for t in succeeded if (v := ttft_s(t)) is not None]),
        itl_s=Distribution.of([gap for t in succeeded for gap in itl_gaps_s(t)]),
        tpot_s=Distribution.of([v for t in succeeded if (v := tpot_s(t)) is not None]),
        e2e_s=Distribution.of([e2e_s(t) for t in succeeded]),
        slo=slo,
        slo_attainment=slo_attainment(traces, slo),
        goodput_rps=goodput_rps(traces, slo, duration_s),
    )
