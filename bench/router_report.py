"""Arithmetic and formatting shared by the router and SLO benchmarks (pure functions).

Percentiles, latency summaries, Markdown tables, machine facts and the replacement
of one `## ` section of docs/benchmarks.md. Nothing here times anything, so the
tests can check every function on synthetic numbers.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tandem.bench.loadgen.metrics import percentile as loadgen_percentile


def percentile(values: Sequence[float], q: float) -> float:
    """`bench.loadgen.metrics.percentile` (numpy-style linear interpolation), but an
    empty sample is an error here: these reports never summarise nothing."""
    if not values:
        raise ValueError("percentile of no values")
    return loadgen_percentile(values, q)


@dataclass(frozen=True)
class LatencySummary:
    """Distribution of one latency, seconds."""

    count: int
    mean_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    max_s: float

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencySummary:
        if not values:
            nan = float("nan")
            return cls(0, nan, nan, nan, nan, nan)
        return cls(
            count=len(values),
            mean_s=sum(values) / len(values),
            p50_s=percentile(values, 50),
            p90_s=percentile(values, 90),
            p99_s=percentile(values, 99),
            max_s=max(values),
        )


def paired_differences(slow: Sequence[float], fast: Sequence[float]) -> list[float]:
    """`slow[i] - fast[i]` for requests measured in pairs (interleaved runs)."""
    if len(slow) != len(fast):
        raise ValueError(f"unpaired samples: {len(slow)} vs {len(fast)}")
    return [a - b for a, b in zip(slow, fast, strict=True)]


def format_ms(seconds: float, digits: int = 2) -> str:
    """Seconds as milliseconds ("—" when unknown)."""
    if math.isnan(seconds):
        return "—"
    return f"{seconds * 1e3:.{digits}f} ms"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table; every row must have one cell per header."""
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {list(row)} has {len(row)} cells, headers {len(headers)}")
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path, data: Any) -> None:
    """Raw results (dataclasses become dicts; NaN is written as null)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_plain(data), indent=2, sort_keys=True) + "\n")


def _plain(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return _plain(asdict(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@dataclass(frozen=True)
class MachineFacts:
    cpu_model: str
    num_cores: int
    python_version: str
    grpc_version: str
    ray_version: str
    date_utc: str
    # 1/5/15-minute load averages when read (other sessions' work skews timings).
    load_average: tuple[float, float, float]

    def sentence(self, load_end: tuple[float, float, float]) -> str:
        start, end = self.load_average, load_end
        return (
            f"**Machine.** {self.cpu_model}, {self.num_cores} cores; Python "
            f"{self.python_version}, grpcio {self.grpc_version}, Ray {self.ray_version}; "
            f"{self.date_utc}. Load average (1/5/15 min, `uptime`) at start "
            f"{start[0]:.2f} / {start[1]:.2f} / {start[2]:.2f}, at end "
            f"{end[0]:.2f} / {end[1]:.2f} / {end[2]:.2f}."
        )


def load_average() -> tuple[float, float, float]:
    one, five, fifteen = os.getloadavg()
    return (one, five, fifteen)


def machine_facts() -> MachineFacts:
    import grpc
    import ray

    cpu_model = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu_model = value.strip()
                break
    return MachineFacts(
        cpu_model=cpu_model,
        num_cores=os.cpu_count() or 0,
        python_version=platform.python_version(),
        grpc_version=grpc.__version__,
        ray_version=ray.__version__,
        date_utc=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        load_average=load_average(),
    )
