"""The engine benchmark's results, roofline and its `## Engine` section of docs/benchmarks.md.

Pure functions of the measured numbers (the tests check them on synthetic ones):
`ModelShape` and the roofline, the result types (`Row`, `Profile`, `DtypeResult`,
`BenchReport`), tables, the generated reading and the whole section.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.bench.engine.timing import MachineFacts, OpTime
from tandem.bench.report import render_table
from tandem.engine.config import ModelConfig

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
    header = "step|engine|transformers|matmul floor|roofline|engine/floor|engine/roofline"
    cells = []
    for row in rows:
        num_runs = len(row.samples.get("engine", []))
        name = f"{row.name} (ctx {row.context})" if row.context else row.name
        name += f", {num_runs} runs" if num_runs else ""
        cells.append(
            [name, f"{format_time(row.engine_s)} ({format_rate(row.num_tokens, row.engine_s)})",
             f"{format_time(row.transformers_s)} "
             f"({format_rate(row.num_tokens, row.transformers_s)})",
             format_time(row.floor_s), f"{format_time(row.roofline_s)} ({row.roofline_bound})",
             f"{row.engine_over_floor:.2f}×", f"{row.engine_over_roofline:.2f}×",
             f"{row.engine_over_transformers:.2f}×", _target_cell(row),
             f"{row.foreign_cores:.2f} cores"]
        )  # fmt: skip
    return render_table(
        [*header.split("|"), "engine/transformers", "target met?", "other load"], cells
    )


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
        return cls(
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
        )

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer's fused qkv, o, gate_up and down projections."""
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        qkv = self.hidden_size * (q_size + 2 * kv_size)
        o = q_size * self.hidden_size
        gate_up = self.hidden_size * 2 * self.intermediate_size
        down = self.intermediate_size * self.hidden_size
        return qkv + o + gate_up + down

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
        """QK^T plus PV FLOPs of one sequence over all layers.

        `context_len` tokens sit in the cache before the `query_len` new ones; a causal
        prefill from position 0 sees on average half of its own chunk.
        """
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
    shape: ModelShape, num_tokens: int, elem_size: int, bandwidth: float, peak_flops: float
) -> Roofline:
    """One prompt of `num_tokens` from position 0; logits for its last token only."""
    kv = shape.kv_elements_per_token * num_tokens * elem_size
    num_bytes = shape.matmul_params * elem_size + kv
    flops = shape.matmul_flops(num_tokens, 1) + shape.attention_flops(num_tokens, 0, causal=True)
    return roofline(num_bytes, flops, bandwidth, peak_flops)


def decode_roofline(
    shape: ModelShape,
    batch_size: int,
    context_len: int,
    elem_size: int,
    bandwidth: float,
    peak_flops: float,
) -> Roofline:
    """One decode step of `batch_size` sequences, each attending to `context_len` cached tokens.

    Bytes are the weights (read once per step, whatever the batch) plus every
    sequence's cached K/V.
    """
    weights = shape.matmul_params * elem_size
    kv = batch_size * context_len * shape.kv_elements_per_token * elem_size
    flops = shape.matmul_flops(batch_size, batch_size)
    flops += batch_size * shape.attention_flops(1, context_len, causal=False)
    return roofline(weights + kv, flops, bandwidth, peak_flops)


def _row(result: DtypeResult, name: str) -> Row | None:
    return next((r for r in result.rows if r.name == name), None)


def _elem_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _decode_sentence(result: DtypeResult) -> str:
    decodes = [r for r in result.rows if r.kind == "decode"]
    if not decodes:
        return ""
    first, last = decodes[0], decodes[-1]
    return (
        f"In {result.dtype}, a batch-{first.num_tokens} decode step takes "
        f"{format_time(first.engine_s)}, {first.engine_over_floor:.2f}× the model's own "
        f"weight matmuls and {first.engine_over_roofline:.2f}× the {first.roofline_bound}-"
        f"bound roofline; at batch {last.num_tokens} it is {last.engine_over_floor:.2f}× "
        f"the floor ({last.num_tokens / last.engine_s:,.0f} tok/s)."
    )


def _floor_sentence(result: DtypeResult, shape: ModelShape) -> str:
    """How far the bare batch-1 matmuls already are from streaming at full bandwidth."""
    b1 = _row(result, "decode b1")
    if b1 is None or b1.roofline_bound != "memory":
        return ""
    weights_gb_s = shape.matmul_params * _elem_size(result.dtype) / b1.floor_s / 1e9
    return (
        f"The batch-1 matmul floor is itself {b1.floor_s / b1.roofline_s:.1f}× the roofline: "
        f"the GEMV kernels stream weights at {weights_gb_s:.1f} GB/s, below the plain-sum "
        "bandwidth, so the floor is the reachable target."
    )


def _dtype_reading(result: DtypeResult, shape: ModelShape) -> str:
    parts = [_decode_sentence(result), _floor_sentence(result, shape)]
    prefill = next((r for r in result.rows if r.kind == "prefill"), None)
    if prefill is not None:
        parts.append(
            f"Prefill of {prefill.num_tokens} tokens runs at "
            f"{prefill.num_tokens / prefill.engine_s:,.0f} tok/s, "
            f"{prefill.engine_over_floor:.2f}× the floor."
        )
    met = sum(r.transformers_met for r in result.rows)
    ratios = [r.engine_over_transformers for r in result.rows]
    parts.append(
        f"The engine is at least as fast as transformers on {met} of {len(result.rows)} "
        f"rows (time ratios {min(ratios):.2f}–{max(ratios):.2f})."
    )
    return " ".join(p for p in parts if p)


def _profiles_reading(profiles: list[Profile]) -> str:
    """The costliest non-GEMM op of each profiled row, grouped by op."""
    by_op: dict[str, list[str]] = {}
    for profile in profiles:
        other = [op for op in profile.ops if op.op not in MATMUL_OPS]
        if other:
            where = f"{profile.dtype} {profile.row} {format_time(other[0].self_s)}"
            by_op.setdefault(other[0].op, []).append(where)
    text = (
        "In the profiles of missed rows the GEMM kernels are the floor itself; the rest is "
        "the engine's overhead"
    )
    if by_op:
        groups = [f"`{op}` ({'; '.join(rows)} per step)" for op, rows in by_op.items()]
        text += ", led by " + ", ".join(groups)
    return text + "."


def _dtype_comparison(report: BenchReport) -> str:
    """bf16 against fp32 engine times, row by row, with the GEMM peaks that explain it."""
    results = {r.dtype: r for r in report.results}
    if "float32" not in results or "bfloat16" not in results:
        return ""
    fp32, bf16 = results["float32"], results["bfloat16"]
    ratios = []
    for row in bf16.rows:
        base = _row(fp32, row.name)
        if base is not None:
            ratios.append(f"{row.name} {row.engine_s / base.engine_s:.2f}×")
    return (
        f"bfloat16 against float32 (engine time ratio): {', '.join(ratios)}. Without native "
        f"bf16 instructions bf16 GEMMs reach {bf16.peak_flops / 1e9:.1f} GFLOP/s against "
        f"{fp32.peak_flops / 1e9:.1f} for float32, so bf16 only pays off where halving the "
        "weight bytes matters more than the arithmetic, i.e. small-batch decode."
    )


def _noise_reading(report: BenchReport) -> str:
    noisy = [
        f"{result.dtype} {row.name} ({row.foreign_cores:.2f})"
        for result in report.results
        for row in result.rows
        if row.foreign_cores > QUIET_MAX_CORES
    ]
    if not noisy:
        return (
            f"Other processes used at most {QUIET_MAX_CORES} cores while any row was measured, "
            "so the numbers are clean."
        )
    return (
        f"Other processes kept cores busy during {', '.join(noisy)} (cores, the last "
        "column): with 2 threads on 2 cores each parallel op then waits for a descheduled "
        "peer, so those rows' absolute times are inflated and noisy; their ratios, from "
        "samples interleaved round by round, are the steadier reading."
    )


def plain_reading(report: BenchReport, shape: ModelShape) -> str:
    parts = [_dtype_reading(r, shape) for r in report.results]
    if report.profiles:
        parts.append(_profiles_reading(report.profiles))
    parts.append(_dtype_comparison(report))
    parts.append(_noise_reading(report))
    return " ".join(p for p in parts if p)


FULL_COMMAND = ".venv/bin/tandem-bench engine"


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f}"


def _machine_paragraph(report: BenchReport) -> str:
    m = report.machine
    bf16 = "native bf16 instructions" if m.has_bf16_instructions else "no native bf16 instructions"
    return (
        f"**Machine.** {m.cpu_model}, {m.num_cores} cores ({m.cpu_capability}, {bf16}); "
        f"torch {m.torch_version}, transformers {m.transformers_version}, "
        f"Python {m.python_version}; torch threads: {m.num_threads}; {m.date_utc}; "
        f"1-minute load average {m.load_average:.2f} at start, "
        f"{report.load_average_end:.2f} at end."
    )


def _ceilings_paragraph(report: BenchReport) -> str:
    peaks = "; ".join(f"{r.dtype} {_gb(r.peak_flops)} GFLOP/s" for r in report.results)
    return (
        f"**Hardware ceilings.** Memory read bandwidth {_gb(report.bandwidth)} GB/s (sum of a "
        f"1 GiB float32 tensor, best of several). Peak GEMM (2048³ `F.linear`, best of "
        f"several): {peaks}."
    )


def _method(shape: ModelShape, report: BenchReport) -> str:
    params = shape.matmul_params
    return "\n".join(
        [
            f"**Method.** `small` preset ({shape.num_layers} layers, hidden {shape.hidden_size}, "
            f"{shape.num_heads} heads / {shape.num_kv_heads} KV heads, intermediate "
            f"{shape.intermediate_size}, vocab {shape.vocab_size}); {params / 1e6:.1f}M "
            "parameters in matmuls (embeddings excluded: a lookup). Times are medians.",
            "",
            "- *prefill 512*: one 512-token request, prefix caching off, the `step()` that "
            "prefills it and samples its first token; fresh request per run, after a warm-up.",
            "- *decode bB*: B sequences with 128-token prompts enter through the decode-side "
            "KV import (`reserve_import`/`commit_import`, as a decode worker does), so every "
            "step yields B tokens; per-step time, context as shown (keys per sequence).",
            f"- *transformers*: `AutoModelForCausalLM`, `attn_implementation="
            f'"{report.hf_attention}"` (its default), same weights, dtype and threads; '
            "prefill = forward of 1×512 with `logits_to_keep=1`; decode = forward of [B, 1] "
            "with a `DynamicCache` already holding 128 tokens.",
            "- *matmul floor*: `F.linear(x, W)` over the engine model's own weight tensors in "
            "model order (per layer qkv, o, gate_up, down; then lm_head on 1 row for prefill, "
            "B rows for decode), x of 512 / B rows, timed as one pass.",
            "- *roofline*: max(bytes ÷ bandwidth, FLOPs ÷ peak); bytes = matmul weights "
            "+ KV cache read; FLOPs = 2 × matmul params × rows + attention; peak = the square "
            "GEMM's, or the rate the row's own matmul floor reached when that is higher "
            "(a square GEMM is not always the fastest shape).",
            "- *targets*: decode ≤ 1.2× matmul floor at batch 1, ≤ 1.3× at larger batches; "
            "prefill ≤ 1.3×; never slower than transformers (engine/transformers ≤ 1).",
        ]
    )


def render_section(report: BenchReport, shape: ModelShape) -> str:
    """The body of `## Engine` (without the heading)."""
    kind = "quick smoke run — not the reference numbers" if report.quick else "full run"
    blocks = [
        f"Command (full run, from the repository root):\n\n```\n{FULL_COMMAND}\n```",
        f"This run: `{report.command}` ({kind}, {report.wall_s / 60:.1f} min).",
        _machine_paragraph(report),
        _ceilings_paragraph(report),
        _method(shape, report),
    ]
    for result in report.results:
        blocks.append(f"### {result.dtype}\n\n{format_table(result.rows)}")
    if report.profiles:
        blocks.append("### Profiles of missed targets")
        blocks += [format_profile(p) for p in report.profiles]
    blocks.append(f"### Reading\n\n{plain_reading(report, shape)}")
    return "\n\n".join(blocks)
