"""The plain-language reading under the engine benchmark's tables, built from the numbers.

Every sentence is derived from the measured rows, so a rerun on another machine (or
after an engine change) rewrites the reading consistently instead of leaving stale prose.
"""

from __future__ import annotations

import torch

from tandem.bench.engine_report import (
    MATMUL_OPS,
    QUIET_MAX_CORES,
    BenchReport,
    DtypeResult,
    Profile,
    Row,
    format_time,
)
from tandem.bench.engine_roofline import ModelShape


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
