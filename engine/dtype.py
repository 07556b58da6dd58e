"""Which dtype an engine runs: `--dtype auto` resolved from the device and the CPU.

`auto` is the checkpoint's dtype on CUDA; on CPU bfloat16 only where the CPU has bf16
GEMM instructions, else float32 (see `auto_dtype` for why flags, not a timing probe).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.engine.config import EngineConfig

# What `--dtype` accepts on `tandem serve`, `tandem demo` and `tandem-bench engine`.
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")

# CPU flags (Linux /proc/cpuinfo) of bf16 GEMM instructions: Intel AMX tiles, and
# AVX512-BF16's pair dot products (AMD Zen 4 and later, Intel Cooper Lake and later). With
# either the engine ran faster in bf16 than in fp32 at every batch (engine table,
# docs/benchmarks.md: on an AMD EPYC with avx512_bf16 and no AMX, decode steps 1.2-2.1x
# and a 512-token prefill 1.8-1.9x faster over three runs). Without them (AVX-512 or AVX2
# only) torch runs bf16 linear layers slower than fp32, so `auto` keeps float32.
BF16_GEMM_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.cache
def cpu_info(cpuinfo: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first CPU's fields of /proc/cpuinfo ("model name", "cpu family", "flags", ...;
    empty where it does not exist)."""
    try:
        first_cpu = Path(cpuinfo).read_text().partition("\n\n")[0]
    except OSError:
        return {}
    return {key.strip(): value.strip() for key, _, value in
            (line.partition(":") for line in first_cpu.splitlines())}  # fmt: skip


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo does not exist)."""
    return frozenset(cpu_info(cpuinfo).get("flags", "").split())


def auto_dtype(device: str, checkpoint_dtype: str, flags: frozenset[str] | None = None) -> str:
    """What `dtype="auto"` runs: the checkpoint's dtype on CUDA; on CPU bfloat16 when the
    CPU has bf16 GEMM instructions (`BF16_GEMM_FLAGS`), else float32.

    Decided from CPU flags, not a timing probe: every worker on a machine type picks the
    same dtype (their KV layouts must match to move KV), start-up costs nothing, and a
    busy machine cannot flip the choice."""
    if device != "cpu":
        name = str(checkpoint_dtype).removeprefix("torch.")
        return name if name in ("float32", "bfloat16", "float16") else "bfloat16"
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if any(f in flags for f in BF16_GEMM_FLAGS) else "float32"


def dtype_banner(config: EngineConfig) -> str:
    """The dtype and why, for start-up banners: "dtype bfloat16 (auto: CPU has amx_bf16)"."""
    resolved = config.resolved_dtype
    if config.dtype != "auto":
        return f"dtype {resolved}"
    if config.device != "cpu":
        return f"dtype {resolved} (auto: the checkpoint's)"
    units = sorted(set(BF16_GEMM_FLAGS) & cpu_flags())
    why = f"CPU has {', '.join(units)}" if units else "no bf16 GEMM instructions on this CPU"
    return f"dtype {resolved} (auto: {why})"
