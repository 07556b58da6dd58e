"""The engine benchmark's results, roofline and tables: pure functions of the numbers."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from tandem.bench.report import render_table
from tandem.engine.config import ModelConfig

SECTION_HEADING = "## Engine"
# The engine may never be slower than transformers (time ratio).
TRANSFORMERS_TARGET = 1.0
# Rows measured while other processes used more cores than this are flagged as noisy.
QUIET_MAX_CORES = 0.25
# Profiler names of the GEMM kernels: the part of a step the matmul floor measures (the
# MLP's gate/up product comes with its SiLU-and-multiply where the two are one call).
MATMUL_OPS = (
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "tandem_cpu::packed_linear",
    "tandem_cpu::packed_silu_and_mul",
)  # fmt: skip


# Row kinds whose step decodes one token per sequence.
DECODE_KINDS = ("decode", "long decode")


def floor_target(kind: str, batch_size: int) -> float | None:
    """Largest acceptable engine ÷ matmul-floor ratio (issue 13): 1.1× for a decode step,
    1.2× for a prefill from position 0; none for a prefix hit or a long-context decode
    (their attention over thousands of cached keys is work the matmul floor leaves out)."""
    if kind in ("prefix hit", "long decode"):
        return None
    return 1.1 if kind == "decode" else 1.2


@dataclass(frozen=True)
class Row:
    """One step shape measured four ways (times are medians, in seconds)."""

    name: str  # "prefill 512", "prefix hit 16", "decode b8", "long decode b1"
    kind: str  # "prefill", "prefix hit", "decode" or "long decode"
    num_tokens: int  # new prompt tokens (prefill, prefix hit) or sequences (decodes)
    engine_s: float
    transformers_s: float
    floor_s: float
    roofline_s: float
    roofline_bound: str  # "memory" or "compute"
    floor_target: float | None  # None: no floor target (see floor_target)
    # Keys each sequence attends to while timed, "first-last" (decode), or "N cached"
    # (prefix hit); "" for a prefill from position 0.
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
        return self.floor_target is None or self.engine_over_floor <= self.floor_target

    @property
    def transformers_met(self) -> bool:
        return self.engine_over_transformers <= TRANSFORMERS_TARGET


@dataclass(frozen=True)
class OpTime:
    op: str
    self_s: float  # children excluded
    percent: float


@dataclass(frozen=True)
class Profile:
    """Where one missed row's engine step spends its time (all times per step)."""

    dtype: str
    row: str
    num_steps: int  # steps run under the profiler
    wall_s: float
    op_s: float  # sum of all ops' self times; the rest of wall_s is outside ops
    matmul_s: float  # self time of the GEMM kernels
    ops: list[OpTime]


@dataclass(frozen=True)
class DtypeResult:
    dtype: str
    peak_flops: float
    rows: list[Row]
    attention_backend: str = ""  # as resolved (`auto` -> `cpu` on CPU)

    @property
    def title(self) -> str:
        if not self.attention_backend:
            return self.dtype
        return f"{self.dtype} · attention backend `{self.attention_backend}`"


@dataclass
class BenchReport:
    command: str
    quick: bool
    machine: dict[str, Any]  # `machine_facts()` plus `measure.torch_facts()`
    bandwidth: float  # bytes/s
    hf_attention: str
    results: list[DtypeResult] = field(default_factory=list)
    profiles: list[Profile] = field(default_factory=list)
    wall_s: float = 0.0
    load_average_end: float = 0.0  # 1-minute load average


def format_time(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def _met(met: bool) -> str:
    return "met" if met else "**missed**"


def _timed(row: Row, seconds: float) -> str:
    return f"{format_time(seconds)} ({row.num_tokens / seconds:,.0f} tok/s)"


def _floor_verdict(row: Row) -> str:
    if row.floor_target is None:
        return "floor: no target"
    return f"floor ≤{row.floor_target:.1f}×: {_met(row.floor_met)}"


def _row_cells(row: Row) -> list[str]:
    num_runs = len(row.samples.get("engine", []))
    name = f"{row.name} (ctx {row.context})" if row.context else row.name
    return [
        name + (f", {num_runs} runs" if num_runs else ""), _timed(row, row.engine_s),
        _timed(row, row.transformers_s), format_time(row.floor_s),
        f"{format_time(row.roofline_s)} ({row.roofline_bound})",
        *(f"{ratio:.2f}×" for ratio in (row.engine_over_floor, row.engine_over_roofline,
                                         row.engine_over_transformers)),
        f"{_floor_verdict(row)}; ≤ HF: {_met(row.transformers_met)}",
        f"{row.foreign_cores:.2f} cores",
    ]  # fmt: skip


TABLE_HEADER = [
    "step", "engine", "transformers", "matmul floor", "roofline", "engine/floor",
    "engine/roofline", "engine/transformers", "target met?", "other load",
]  # fmt: skip


def format_table(rows: list[Row]) -> str:
    return render_table(TABLE_HEADER, [_row_cells(row) for row in rows])


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
    ]
    rows = [[f"`{op.op}`", format_time(op.self_s), f"{op.percent:.1f}%"] for op in profile.ops]
    return "\n".join([*lines, render_table(["op", "self time", "%"], rows)])


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide a Llama step's matmul FLOPs and memory traffic."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> ModelShape:
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer's fused qkv, o, gate_up and down projections."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (2 * q_size + 2 * kv_size)
        return attention + 3 * self.hidden_size * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def matmul_params(self) -> int:
        """Every weight a step multiplies by: all layers plus the LM head (no embeddings)."""
        return self.num_layers * self.layer_matmul_params + self.lm_head_params

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token keeps in the cache, across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def matmul_flops(self, num_rows: int, num_logit_rows: int) -> float:
        """FLOPs of the weight matmuls for `num_rows` tokens, `num_logit_rows` of them to logits."""
        layers = 2.0 * self.num_layers * self.layer_matmul_params * num_rows
        return layers + 2.0 * self.lm_head_params * num_logit_rows

    def attention_flops(self, query_len: int, context_len: int, causal: bool) -> float:
        """QK^T plus PV FLOPs of one sequence over all layers, `context_len` tokens cached."""
        if causal:
            num_pairs = query_len * context_len + query_len * (query_len + 1) / 2
        else:
            num_pairs = query_len * (context_len + query_len)
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * num_pairs


@dataclass(frozen=True)
class Roofline:
    """Lower bound on one step's time: the slower of moving its bytes and doing its FLOPs."""

    num_bytes: float
    flops: float
    memory_s: float
    compute_s: float

    @property
    def time_s(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"


def roofline(num_bytes: float, flops: float, bandwidth: float, peak_flops: float) -> Roofline:
    """`bandwidth` in bytes/s, `peak_flops` in FLOP/s (both measured, both > 0)."""
    if bandwidth <= 0 or peak_flops <= 0:
        raise ValueError(f"bandwidth and peak must be > 0, got {bandwidth}, {peak_flops}")
    return Roofline(num_bytes, flops, num_bytes / bandwidth, flops / peak_flops)


def prefill_roofline(
    shape: ModelShape, num_tokens: int, elem_size: int, bandwidth: float, peak_flops: float,
    context_len: int = 0,
) -> Roofline:  # fmt: skip
    """`num_tokens` prompt tokens after `context_len` cached ones (whose K/V it reads);
    logits for its last token only."""
    kv = shape.kv_elements_per_token * (context_len + num_tokens) * elem_size
    num_bytes = shape.matmul_params * elem_size + kv
    flops = shape.matmul_flops(num_tokens, 1)
    flops += shape.attention_flops(num_tokens, context_len, causal=True)
    return roofline(num_bytes, flops, bandwidth, peak_flops)


def decode_roofline(
    shape: ModelShape, batch_size: int, context_len: int, elem_size: int, bandwidth: float,
    peak_flops: float,
) -> Roofline:  # fmt: skip
    """One decode step: weights read once, plus each sequence's `context_len` cached K/V."""
    weights = shape.matmul_params * elem_size
    kv = batch_size * context_len * shape.kv_elements_per_token * elem_size
    flops = shape.matmul_flops(batch_size, batch_size)
    flops += batch_size * shape.attention_flops(1, context_len, causal=False)
    return roofline(weights + kv, flops, bandwidth, peak_flops)


FULL_COMMAND = ".venv/bin/tandem-bench engine"


def _machine_paragraph(report: BenchReport) -> str:
    m = report.machine
    flags = m["bf16_instructions"]  # the CPU flags of bf16 instructions found
    bf16 = f"bf16 instructions: {', '.join(flags)}" if flags else "no bf16 instructions"
    return (
        f"**Machine.** {m['cpu']}, {m['cores']} cores ({m['cpu_capability']}, {bf16}); torch "
        f"{m['torch']}, transformers {m['transformers']}, Python {m['python']}; torch threads: "
        f"{m['threads']}; {m['started']}; 1-minute load average "
        f"{m['load_avg_1m_at_start']:.2f} at start, {report.load_average_end:.2f} at end."
    )


def _ceilings_paragraph(report: BenchReport) -> str:
    by_dtype = {r.dtype: r.peak_flops for r in report.results}
    peaks = "; ".join(f"{dtype} {peak / 1e9:.1f} GFLOP/s" for dtype, peak in by_dtype.items())
    return (
        f"**Hardware ceilings.** Memory read bandwidth {report.bandwidth / 1e9:.1f} GB/s "
        "(sum of a 1 GiB float32 tensor, best of several). Peak GEMM (2048³ `F.linear`, "
        f"best of several): {peaks}."
    )


def render_section(report: BenchReport) -> list[str]:
    """The generated blocks: the run and its machine, then the tables."""
    kind = "quick smoke run — not the reference numbers" if report.quick else "full run"
    run = [
        f"Command (full run, from the repository root):\n\n```\n{FULL_COMMAND}\n```",
        f"This run: `{report.command}` ({kind}, {report.wall_s / 60:.1f} min).",
        _machine_paragraph(report),
        _ceilings_paragraph(report),
    ]
    tables = [f"### {result.title}\n\n{format_table(result.rows)}" for result in report.results]
    if report.profiles:
        tables.append("### Profiles of missed targets")
        tables += [format_profile(p) for p in report.profiles]
    return ["\n\n".join(run), "\n\n".join(tables)]
