"""Renders a `BenchReport` as the `## Engine` section of docs/benchmarks.md.

Layout only: machine facts, method, one table per dtype, profiles, and the plain
reading that `engine_reading` generates from the numbers.
"""

from __future__ import annotations

from tandem.bench.engine_reading import plain_reading
from tandem.bench.engine_report import BenchReport, format_profile, format_table
from tandem.bench.engine_roofline import ModelShape

FULL_COMMAND = "PYTHONPATH=. .venv/bin/python -m bench.engine_bench"


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
