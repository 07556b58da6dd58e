"""How busy the rest of the machine is: CPU used by other processes, in cores.

On a 2-core machine one busy neighbour stalls every 2-thread parallel region of the
benchmark (a thread waits for its descheduled peer), inflating small ops many-fold.
The benchmark records this "foreign" load for every row and can wait for a quiet
moment before measuring. Linux only (`/proc/stat`); elsewhere the load reads as 0.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

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
