"""Results of the engine benchmark: typed rows, targets, the markdown section, the JSON.

The markdown goes under `## Engine` in docs/benchmarks.md; only that section is
replaced, so other benchmarks can share the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.bench.engine_hardware import MachineFacts
from tandem.bench.engine_timing import OpTime

SECTION_HEADING = "## Engine"
# The engine may never be slower than transformers (time ratio).
TRANSFORMERS_TARGET = 1.0
# Rows measured while other processes used more cores than this are flagged as noisy.
QUIET_MAX_CORES = 0.25
# Profiler names of the GEMM kernels: the part of a step the matmul floor measures.
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def floor_target(kind: str, batch_size: int) -> float:
    """Largest acceptable engine ÷ matmul-floor ratio for a row.

    Batch 1 decode gets 1.2×; larger batches 1.3× (only 1 and 32 are specified, so
    batch 8 is held to the looser one); prefill 1.3×.
    """
    if kind == "decode" and batch_size == 1:
        return 1.2
    return 1.3


@dataclass(frozen=True)
class Row:
    """One step shape measured four ways (times are medians, in seconds)."""

    name: str  # "prefill 512", "decode b8"
    kind: str  # "prefill" or "decode"
    # Prompt tokens (prefill) or sequences (decode) the step handles.
    num_tokens: int
    engine_s: float
    transformers_s: float
    floor_s: float
    roofline_s: float
    roofline_bound: str  # "memory" or "compute"
    floor_target: float
    # Keys each sequence attends to while timed, "first-last" ("" for prefill).
    context: str = ""
    # Average cores other processes kept busy while this row was measured.
    foreign_cores: float = 0.0
    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def engine_over_floor(self) -> float:
        return self.engine_s / self.floor_s

    @property
    def engine_over_roofline(self) -> float:
        return self.engine_s / self.roofline_s

    @property
    def engine_over_transformers(self) -> float:
        return self.engine_s / self.transformers_s

    @property
    def floor_met(self) -> bool:
        return self.engine_over_floor <= self.floor_target

    @property
    def transformers_met(self) -> bool:
        return self.engine_over_transformers <= TRANSFORMERS_TARGET

    def to_json(self) -> dict[str, object]:
        return {
            **self.__dict__,
            "engine_over_floor": self.engine_over_floor,
            "engine_over_roofline": self.engine_over_roofline,
            "engine_over_transformers": self.engine_over_transformers,
            "floor_met": self.floor_met,
            "transformers_met": self.transformers_met,
        }


@dataclass(frozen=True)
class Profile:
    """Where one missed row's engine step spends its time (all times per step)."""

    dtype: str
    row: str
    num_steps: int  # steps run under the profiler
    wall_s: float
    # Sum of all ops' self times; wall_s - op_s is Python and framework time outside ops.
    op_s: float
    # Self time of the GEMM kernels (aten::mm / addmm / ...).
    matmul_s: float
    ops: list[OpTime]


@dataclass(frozen=True)
class DtypeResult:
    dtype: str
    peak_flops: float
    rows: list[Row]


@dataclass
class BenchReport:
    command: str
    quick: bool
    machine: MachineFacts
    bandwidth: float  # bytes/s
    hf_attention: str
    results: list[DtypeResult] = field(default_factory=list)
    profiles: list[Profile] = field(default_factory=list)
    wall_s: float = 0.0
    # 1-minute load average when the run ended (the start is in `machine`).
    load_average_end: float = 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "command": self.command,
            "quick": self.quick,
            "machine": self.machine.__dict__,
            "bandwidth_bytes_s": self.bandwidth,
            "hf_attention": self.hf_attention,
            "wall_s": self.wall_s,
            "load_average_end": self.load_average_end,
            "results": [
                {
                    "dtype": r.dtype,
                    "peak_flops": r.peak_flops,
                    "rows": [x.to_json() for x in r.rows],
                }
                for r in self.results
            ],
            "profiles": [{**p.__dict__, "ops": [o.__dict__ for o in p.ops]} for p in self.profiles],
        }


def format_time(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def format_rate(num_tokens: int, seconds: float) -> str:
    return f"{num_tokens / seconds:,.0f} tok/s"


def _target_cell(row: Row) -> str:
    floor = "met" if row.floor_met else "**missed**"
    hf = "met" if row.transformers_met else "**missed**"
    return f"floor ≤{row.floor_target:.1f}×: {floor}; ≤ HF: {hf}"


def format_table(rows: list[Row]) -> str:
    header = (
        "| step | engine | transformers | matmul floor | roofline | engine/floor "
        "| engine/roofline | engine/transformers | target met? | other load |"
    )
    lines = [header, "|" + "---|" * 10]
    for row in rows:
        num_runs = len(row.samples.get("engine", []))
        name = f"{row.name} (ctx {row.context})" if row.context else row.name
        name += f", {num_runs} runs" if num_runs else ""
        lines.append(
            f"| {name} "
            f"| {format_time(row.engine_s)} ({format_rate(row.num_tokens, row.engine_s)}) "
            f"| {format_time(row.transformers_s)} "
            f"({format_rate(row.num_tokens, row.transformers_s)}) "
            f"| {format_time(row.floor_s)} "
            f"| {format_time(row.roofline_s)} ({row.roofline_bound}) "
            f"| {row.engine_over_floor:.2f}× | {row.engine_over_roofline:.2f}× "
            f"| {row.engine_over_transformers:.2f}× | {_target_cell(row)} "
            f"| {row.foreign_cores:.2f} cores |"
        )
    return "\n".join(lines)


def format_profile(profile: Profile) -> str:
    outside_s = max(0.0, profile.wall_s - profile.op_s)
    steps = "1 step" if profile.num_steps == 1 else f"{profile.num_steps} steps"
    lines = [
        f"**{profile.dtype} {profile.row}** (engine, {steps} under `torch.profiler`), per "
        f"step: {format_time(profile.wall_s)} wall, {format_time(profile.op_s)} in torch ops "
        f"of which GEMM {format_time(profile.matmul_s)}, {format_time(outside_s)} outside ops "
        "(Python: scheduling, input preparation, module calls, detokenizing, plus the "
        "profiler's own per-op cost). Top ops by self CPU time:",
        "",
        "| op | self time | % |",
        "|---|---|---|",
    ]
    lines += [f"| `{op.op}` | {format_time(op.self_s)} | {op.percent:.1f}% |" for op in profile.ops]
    return "\n".join(lines)
