"""SLO arithmetic of the admission benchmark (pure functions, tested on synthetic data).

An *outcome* is what the client saw of one request: shed (`RESOURCE_EXHAUSTED` before
any token), failed (any other error), or finished with a TTFT and a mean inter-token
latency. A request *attains* its SLO when it finished with TTFT ≤ the target and (if
there is an ITL target) mean ITL ≤ that target, as `router.policy.slo.Slo.attained`
defines it. Goodput = attaining requests per second of the arrival window.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.bench.router_load import StreamTiming
from tandem.bench.router_report import LatencySummary

SHED_STATUS = "RESOURCE_EXHAUSTED"


def poisson_arrivals(rate_per_s: float, duration_s: float, seed: int) -> list[float]:
    """Arrival offsets (seconds from the start) of a Poisson process within `duration_s`."""
    if rate_per_s <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be > 0, got {rate_per_s}, {duration_s}")
    rng = random.Random(seed)
    arrivals: list[float] = []
    t = rng.expovariate(rate_per_s)
    while t < duration_s:
        arrivals.append(t)
        t += rng.expovariate(rate_per_s)
    return arrivals


def mean_itl_s(token_times_s: Sequence[float]) -> float | None:
    """Mean gap between tokens after the first (None with fewer than two tokens)."""
    if len(token_times_s) < 2:
        return None
    return (token_times_s[-1] - token_times_s[0]) / (len(token_times_s) - 1)


@dataclass(frozen=True)
class Outcome:
    # Seconds from the start of the run to when the request was sent.
    sent_at_s: float
    # gRPC status name; "" when the request finished.
    error: str
    # Whether any token arrived before the error (a shed request gets none).
    got_tokens: bool
    ttft_s: float | None
    mean_itl_s: float | None
    # Seconds from sending to the end of the call (for a shed request: the rejection).
    e2e_s: float

    @property
    def shed(self) -> bool:
        return self.error == SHED_STATUS and not self.got_tokens

    @property
    def admitted(self) -> bool:
        return not self.shed

    @property
    def finished(self) -> bool:
        return not self.error

    def attained(self, ttft_target_s: float, itl_target_s: float | None) -> bool:
        if not self.finished or self.ttft_s is None or self.ttft_s > ttft_target_s:
            return False
        return itl_target_s is None or self.mean_itl_s is None or self.mean_itl_s <= itl_target_s


def outcome_of(timing: StreamTiming, run_start_s: float) -> Outcome:
    return Outcome(
        sent_at_s=timing.start_s - run_start_s,
        error=timing.error,
        got_tokens=bool(timing.token_times_s),
        ttft_s=timing.ttft_s,
        mean_itl_s=mean_itl_s(timing.token_times_s),
        e2e_s=timing.e2e_s,
    )


@dataclass(frozen=True)
class RunSummary:
    duration_s: float
    ttft_target_s: float
    itl_target_s: float | None
    num_offered: int
    num_shed: int
    # Admitted requests that failed with an error other than shedding.
    num_failed: int
    num_attained: int
    offered_rate: float
    admitted_fraction: float
    # Attaining / admitted (NaN when nothing was admitted).
    attainment: float
    # Attaining requests per second of the arrival window.
    goodput: float
    ttft: LatencySummary
    mean_itl: LatencySummary
    # How long a shed request waited for its rejection.
    shed_latency: LatencySummary
    errors: dict[str, int]


def summarize(
    outcomes: Sequence[Outcome],
    duration_s: float,
    ttft_target_s: float,
    itl_target_s: float | None = None,
) -> RunSummary:
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    admitted = [o for o in outcomes if o.admitted]
    finished = [o for o in admitted if o.finished]
    attained = [o for o in admitted if o.attained(ttft_target_s, itl_target_s)]
    errors: dict[str, int] = {}
    for o in admitted:
        if o.error:
            errors[o.error] = errors.get(o.error, 0) + 1
    n = len(outcomes)
    return RunSummary(
        duration_s=duration_s,
        ttft_target_s=ttft_target_s,
        itl_target_s=itl_target_s,
        num_offered=n,
        num_shed=n - len(admitted),
        num_failed=len(admitted) - len(finished),
        num_attained=len(attained),
        offered_rate=n / duration_s,
        admitted_fraction=len(admitted) / n if n else math.nan,
        attainment=len(attained) / len(admitted) if admitted else math.nan,
        goodput=len(attained) / duration_s,
        ttft=LatencySummary.of([o.ttft_s for o in finished if o.ttft_s is not None]),
        mean_itl=LatencySummary.of([o.mean_itl_s for o in finished if o.mean_itl_s is not None]),
        shed_latency=LatencySummary.of([o.e2e_s for o in outcomes if o.shed]),
        errors=errors,
    )


@dataclass(frozen=True)
class Probe:
    """One capacity probe: a Poisson rate with no admission control, and its result."""

    rate_per_s: float
    summary: RunSummary

    def passed(self, min_attainment: float) -> bool:
        s = self.summary
        return s.num_failed == 0 and s.attainment >= min_attainment


def capacity_of(probes: Sequence[Probe], min_attainment: float) -> float | None:
    """The highest probed rate that kept attainment ≥ `min_attainment` below the first
    rate that did not (probes are in increasing order); None if even the first failed."""
    best = None
    for probe in sorted(probes, key=lambda p: p.rate_per_s):
        if not probe.passed(min_attainment):
            break
        best = probe.rate_per_s
    return best
