"""Timing, machine load and hardware ceilings of the engine benchmark."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
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


_PROC_STAT = Path("/proc/stat")
# /proc/stat "cpu" columns counted as busy: user nice system (idle iowait) irq softirq steal.
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


@dataclass(frozen=True)
class CpuSnapshot:
    """Machine-wide busy CPU seconds, this process's CPU seconds, and when."""

    busy_s: float
    own_s: float
    wall_s: float


def busy_seconds(proc_stat_text: str, ticks_per_s: float) -> float:
    """Busy CPU seconds of all cores from the aggregate `cpu` line of /proc/stat."""
    for line in proc_stat_text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(v) for v in fields[1:]]
            return sum(values[i] for i in _BUSY_COLUMNS if i < len(values)) / ticks_per_s
    raise ValueError("no aggregate 'cpu' line in /proc/stat text")


def snapshot() -> CpuSnapshot:
    times = os.times()
    own_s = times.user + times.system
    if not _PROC_STAT.is_file():
        return CpuSnapshot(own_s, own_s, time.monotonic())
    busy_s = busy_seconds(_PROC_STAT.read_text(), os.sysconf("SC_CLK_TCK"))
    return CpuSnapshot(busy_s, own_s, time.monotonic())


def foreign_cores(start: CpuSnapshot, end: CpuSnapshot) -> float:
    """Average cores other processes kept busy between two snapshots."""
    elapsed = end.wall_s - start.wall_s
    if elapsed <= 0:
        return 0.0
    foreign = (end.busy_s - start.busy_s) - (end.own_s - start.own_s)
    return max(0.0, foreign / elapsed)


def wait_until_quiet(max_cores: float, timeout_s: float, probe_s: float = 1.0) -> float:
    """Probe until others use at most `max_cores` (or `timeout_s` passes); the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        start = snapshot()
        time.sleep(probe_s)
        load = foreign_cores(start, snapshot())
        if load <= max_cores or time.monotonic() >= deadline:
            return load


def torch_facts(num_threads: int) -> dict[str, Any]:
    """What the engine's times depend on beyond `bench.report.machine_facts()`."""
    import transformers

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    bf16 = {"avx512_bf16", "amx_bf16", "avx_ne_convert"}
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_instructions": bool(set(flags.split()) & bf16),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": num_threads,
    }


def measure_bandwidth(num_bytes: int = 1 << 30, num_runs: int = 5) -> float:
    """Bytes/s of summing a `num_bytes` float32 tensor (best of `num_runs`)."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    data.sum()  # fault the pages in before timing
    best = min(time_call(data.sum) for _ in range(num_runs))
    return num_bytes / best


def measure_peak_flops(dtype: torch.dtype, size: int = 2048, num_runs: int = 3) -> float:
    """FLOP/s of a square `size` GEMM in `dtype` (best of `num_runs`).

    Uses `F.linear` (x @ W^T), the layout every model projection has; on CPUs without
    bf16 instructions torch's plain `a @ b` takes a far slower bf16 path.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size, size, generator=gen).to(dtype)
    weight = torch.randn(size, size, generator=gen).to(dtype)
    with torch.inference_mode():
        F.linear(x, weight)
        best = min(time_call(lambda: F.linear(x, weight)) for _ in range(num_runs))
    return 2.0 * size**3 / best
