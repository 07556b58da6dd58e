"""Timing helpers of the engine benchmark: bounded interleaved repeats, medians, profiles.

Every measurement runs between `min_runs` and `max_runs` times and stops early once
its time budget is spent, so slow configurations (bf16 on CPUs without bf16
instructions) keep the whole benchmark bounded while fast ones get more samples.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class RepeatPolicy:
    """How often one measurement repeats (warm-up runs are not recorded)."""

    num_warmup: int
    min_runs: int
    max_runs: int
    # Stop after `min_runs` once this much wall time (set-up included) has passed.
    budget_s: float

    def __post_init__(self) -> None:
        if self.num_warmup < 0 or not 1 <= self.min_runs <= self.max_runs:
            raise ValueError(f"bad repeat policy {self}")
        if self.budget_s <= 0:
            raise ValueError(f"budget_s must be > 0, got {self.budget_s}")


def median(values: list[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def repeat_interleaved(
    timers: dict[str, Callable[[], float]], policy: RepeatPolicy
) -> dict[str, list[float]]:
    """Samples of every timer, taken in rounds (one call of each per round).

    Each timer returns the seconds it measured. Interleaving keeps the samples being
    compared close in time, so load from other processes skews them alike.
    """
    for _ in range(policy.num_warmup):
        for timer in timers.values():
            timer()
    samples: dict[str, list[float]] = {name: [] for name in timers}
    start = time.perf_counter()
    for num_rounds in range(1, policy.max_runs + 1):
        for name, timer in timers.items():
            samples[name].append(timer())
        spent = time.perf_counter() - start
        if num_rounds >= policy.min_runs and spent >= policy.budget_s:
            break
    return samples


def time_call(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass(frozen=True)
class OpTime:
    """One row of a CPU profile: an operator's own time (children excluded)."""

    op: str
    self_s: float
    percent: float


def top_ops(self_times_us: dict[str, float], num_ops: int) -> list[OpTime]:
    """The `num_ops` largest self times, with their share of the total."""
    total = sum(self_times_us.values())
    ranked = sorted(self_times_us.items(), key=lambda item: item[1], reverse=True)
    return [
        OpTime(op, us / 1e6, 100.0 * us / total if total else 0.0) for op, us in ranked[:num_ops]
    ]


@dataclass(frozen=True)
class OpProfile:
    """What one profiled call spent, per op and in total."""

    # Self CPU microseconds per op name (children excluded, so they add up).
    self_times_us: dict[str, float]
    # Wall time of the whole call under the profiler.
    wall_s: float


def profile_self_times(fn: Callable[[], object]) -> OpProfile:
    """Run `fn` once under the CPU profiler."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall_s = time_call(fn)
    self_times = {evt.key: float(evt.self_cpu_time_total) for evt in prof.key_averages()}
    return OpProfile(self_times, wall_s)
