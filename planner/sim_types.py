"""What a simulation is asked and what it reports: layout, SLOs, settings, report."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from tandem.planner.profile_format import EngineLimits

DEFAULT_KV_LEASE_S = 30.0


@dataclass(frozen=True)
class Layout:
    """A cluster shape: prefill + decode pools, or colocated workers."""

    num_prefill: int = 0
    num_decode: int = 0
    num_colocated: int = 0

    def __post_init__(self) -> None:
        if self.num_colocated:
            if self.num_prefill or self.num_decode or self.num_colocated < 1:
                raise ValueError("a colocated layout has only colocated workers")
        elif self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("a disaggregated layout needs >= 1 prefill and >= 1 decode worker")

    @property
    def num_workers(self) -> int:
        return self.num_prefill + self.num_decode + self.num_colocated

    @property
    def label(self) -> str:
        if self.num_colocated:
            return f"{self.num_colocated} colocated"
        return f"{self.num_prefill}P+{self.num_decode}D"


@dataclass(frozen=True)
class SloTargets:
    ttft_s: float
    # Time per output token after the first: (last token - first token) / (tokens - 1).
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError("SLO targets must be > 0")


@dataclass(frozen=True)
class SimSettings:
    """The router and engine settings the simulation mirrors."""

    limits: EngineLimits
    kv_lease_s: float = DEFAULT_KV_LEASE_S
    max_local_prefill_tokens: int = 512
    seed: int = 0
    # Cores the workers share (all on one CPU node, see `sim_cores`); None: not shared.
    shared_cores: float | None = None
    # torch threads per worker (with `shared_cores`).
    threads_per_worker: int = 1


@dataclass
class SimReport:
    layout: Layout
    rate_rps: float
    num_requests: int
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    num_met: int = 0
    num_missed: int = 0
    # Requests that missed the TTFT target, and those that missed only the TPOT one.
    num_ttft_missed: int = 0
    num_tpot_missed: int = 0
    # The run stopped once it could no longer reach its attainment floor.
    stopped_early: bool = False
    # Requests still unfinished when a run with `until_s` stopped (counted as missed).
    num_cut: int = 0
    decisions: Counter[str] = field(default_factory=Counter)

    @property
    def attainment(self) -> float:
        """Share of requests within both SLOs (an upper bound when stopped early)."""
        return (self.num_requests - self.num_missed) / self.num_requests

    @property
    def goodput_rps(self) -> float:
        return self.rate_rps * self.attainment

    def percentile(self, values: list[float], q: float) -> float:
        if not values:
            return math.nan
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]
