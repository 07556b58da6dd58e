"""What the machine can do at best: memory read bandwidth, peak GEMM FLOP/s, and facts.

These set the hardware roofline the engine is compared with. Both numbers are the best
of several runs at the benchmark's thread count: a roofline is a ceiling, so the best
run is the honest estimate of it.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.bench.engine_timing import time_call


@dataclass(frozen=True)
class MachineFacts:
    cpu_model: str
    num_cores: int
    # torch's SIMD level (AVX2, AVX512, ...) and whether the CPU has native bf16 math.
    cpu_capability: str
    has_bf16_instructions: bool
    torch_version: str
    transformers_version: str
    python_version: str
    num_threads: int
    date_utc: str
    # 1-minute load average when the benchmark started (others' work skews timings).
    load_average: float


def _cpuinfo_field(text: str, name: str) -> str:
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return "unknown"


def machine_facts(num_threads: int) -> MachineFacts:
    import transformers

    cpuinfo_path = Path("/proc/cpuinfo")
    cpuinfo = cpuinfo_path.read_text() if cpuinfo_path.is_file() else ""
    flags = set(_cpuinfo_field(cpuinfo, "flags").split())
    return MachineFacts(
        cpu_model=_cpuinfo_field(cpuinfo, "model name"),
        num_cores=os.cpu_count() or 0,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        has_bf16_instructions=bool(flags & {"avx512_bf16", "amx_bf16", "avx_ne_convert"}),
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        python_version=platform.python_version(),
        num_threads=num_threads,
        date_utc=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        load_average=os.getloadavg()[0],
    )


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
