"""`tandem-bench engine`: the engine against its matmul floor, the roofline and HF."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.bench.engine import hf_timers, measure, report
from tandem.bench.engine.measure import RepeatPolicy, Subjects
from tandem.bench.harness import ensure_model
from tandem.bench.report import machine_facts, publish, write_json
from tandem.engine.config import ModelConfig
from tandem.engine.dtype import auto_dtype

DEFAULT_OUT = "docs/benchmarks.md"
FULL_RUNS = (
    ("float32", "auto"), ("float32", "torch"), ("bfloat16", "auto"), ("bfloat16", "torch"),
)  # fmt: skip
RESULTS_DIR = Path("bench/results")


@dataclass(frozen=True)
class BenchPlan:
    """What one run measures and how often."""

    model_dir: str
    # (dtype, attention backend) per table; `auto` is what `tandem serve` picks.
    runs: tuple[tuple[str, str], ...]
    batch_sizes: tuple[int, ...]
    num_threads: int
    prefill: RepeatPolicy
    decode: RepeatPolicy
    num_hardware_runs: int
    quick: bool
    # Before each row, wait up to this long for other processes to go quiet (0: never).
    quiet_wait_s: float
    max_attempts: int  # measurements of a row at most, while other processes keep disturbing it
    prefill_len: int = 512
    prompt_len: int = 128
    # The prefix-hit row: prefix_new fresh tokens after prefix_len cached ones.
    prefix_len: int = 1008
    prefix_new: int = 16
    # The long-context decode row's prompt (one sequence), at most what the model's
    # positions leave room for.
    long_prompt_len: int = 3840

    @property
    def decode_seq_len(self) -> int:
        return self.prompt_len + measure.decode_max_tokens(self.decode)

    def long_prompt_len_for(self, max_positions: int) -> int:
        return min(self.long_prompt_len, max_positions - measure.decode_max_tokens(self.decode) - 1)


def make_plan(args: argparse.Namespace) -> BenchPlan:
    """A full run: float32 and bfloat16, each with the backend `auto` picks and with the
    `torch` reference backend. `--quick`: float32 only, batch 1 and 8, few repeats, no
    waiting for quiet. `--dtype`: that dtype only. Two torch threads (the published
    machine's cores)."""
    quick = bool(args.quick)
    runs = (("float32", "auto"),) if quick else FULL_RUNS
    if getattr(args, "dtype", None):
        runs = ((auto_dtype("cpu", "float32") if args.dtype == "auto" else args.dtype, "auto"),)
    return BenchPlan(
        model_dir=str(args.model),
        runs=runs,
        batch_sizes=(1, 8) if quick else (1, 8, 32),
        num_threads=2,
        prefill=RepeatPolicy(1, 2, 3, budget_s=3.0) if quick else RepeatPolicy(1, 3, 5, 15.0),
        decode=RepeatPolicy(2, 5, 8, budget_s=2.0) if quick else RepeatPolicy(2, 5, 20, 8.0),
        num_hardware_runs=2 if quick else 5,
        quick=quick,
        quiet_wait_s=0.0 if quick else 60.0,
        max_attempts=1 if quick else 2,
    )


def _say(message: str) -> None:
    print(message, flush=True)


def _wait_quiet(plan: BenchPlan) -> None:
    if plan.quiet_wait_s <= 0:
        return
    load = measure.wait_until_quiet(report.QUIET_MAX_CORES, plan.quiet_wait_s)
    if load > report.QUIET_MAX_CORES:
        _say(f"  other processes still use {load:.2f} cores; measuring anyway")


def _measure_row(plan: BenchPlan, measure: Callable[[], report.Row]) -> report.Row:
    """`measure()` once the machine is quiet, again while others disturbed it (bounded)."""
    rows = []
    for _ in range(plan.max_attempts):
        _wait_quiet(plan)
        rows.append(row := measure())
        _say(
            f"  {row.name}: engine {row.engine_s * 1e3:.1f} ms, transformers "
            f"{row.transformers_s * 1e3:.1f} ms, floor {row.floor_s * 1e3:.1f} ms "
            f"(other processes: {row.foreign_cores:.2f} cores)"
        )
        if row.foreign_cores <= report.QUIET_MAX_CORES:
            break
    return min(rows, key=lambda row: row.foreign_cores)


def _measure_rows(plan: BenchPlan, subjects: Subjects, prompt: list[int]) -> list[report.Row]:
    prefill = functools.partial(measure.prefill_row, subjects, prompt, plan.prefill)
    decodes = [
        functools.partial(measure.decode_row, subjects, batch, plan.prompt_len, plan.decode)
        for batch in plan.batch_sizes
    ]
    return [_measure_row(plan, row) for row in (prefill, *decodes)]


def _prefix_hit_row(
    plan: BenchPlan, subjects: Subjects, dtype: str, backend: str
) -> tuple[report.Row, list[report.Profile]]:
    """The prefix-hit row, by an engine of its own with prefix caching on (the other rows'
    engine has it off: their prefills must not hit), and its profile where it misses a
    target and `backend` is what `auto` picks."""
    engine = measure.build_engine(
        plan.model_dir, dtype, plan.num_threads, plan.prefill_len, 2,
        plan.prefix_len + plan.prefix_new, backend, enable_prefix_caching=True,
    )  # fmt: skip
    prefix = measure.random_prompt(plan.prefix_len, subjects.shape.vocab_size, seed=plan.prefix_len)
    hit = measure.PrefixHit(engine, prefix, plan.prefix_new)
    row = _measure_row(plan, functools.partial(measure.prefix_hit_row, subjects, hit, plan.decode))
    profiles = []
    if backend == "auto" and not (row.floor_met and row.transformers_met):
        _wait_quiet(plan)
        profiles.append(measure.profile_prefix_hit(hit, dtype, row.name))
    del hit, engine
    gc.collect()
    return row, profiles


def _long_decode_row(
    plan: BenchPlan, subjects: Subjects, dtype: str, backend: str
) -> tuple[report.Row, list[report.Profile]]:
    """The long-context decode row (one sequence after a prompt of thousands of tokens), by
    an engine of its own sized for it, and its profile where it misses a target and
    `backend` is what `auto` picks."""
    prompt_len = plan.long_prompt_len_for(subjects.engine.model_config.max_position_embeddings)
    engine = measure.build_engine(
        plan.model_dir, dtype, plan.num_threads, plan.prefill_len, 1,
        prompt_len + measure.decode_max_tokens(plan.decode), backend,
    )  # fmt: skip
    long_subjects = dataclasses.replace(subjects, engine=engine)
    row = _measure_row(plan, functools.partial(
        measure.decode_row, long_subjects, 1, prompt_len, plan.decode, kind="long decode",
    ))  # fmt: skip
    profiles = []
    if backend == "auto" and not (row.floor_met and row.transformers_met):
        _wait_quiet(plan)
        steps = measure.NUM_PROFILE_STEPS
        self_times_us, wall_s = measure.profile_decode(engine, 1, prompt_len, steps)
        profiles.append(measure.profile_of_steps(dtype, row.name, steps, self_times_us, wall_s))
    del long_subjects, engine
    gc.collect()
    return row, profiles


def _run_dtype(
    plan: BenchPlan, dtype: str, backend: str, shape: report.ModelShape, bandwidth: float,
    peaks: dict[str, float],
) -> tuple[report.DtypeResult, list[report.Profile]]:  # fmt: skip
    """One table: `dtype` with attention `backend`; profiles of its missed rows, for the
    backend `auto` picks only (`torch` is the reference, not the serving path)."""
    torch_dtype = getattr(torch, dtype)
    if dtype not in peaks:
        _wait_quiet(plan)
        peaks[dtype] = measure.measure_peak_flops(torch_dtype, num_runs=plan.num_hardware_runs)
        _say(f"{dtype}: peak GEMM {peaks[dtype] / 1e9:.1f} GFLOP/s")
    peak = peaks[dtype]
    engine = measure.build_engine(
        plan.model_dir, dtype, plan.num_threads, plan.prefill_len, max(plan.batch_sizes),
        plan.decode_seq_len, backend,
    )  # fmt: skip
    resolved = engine.config.resolved_attention_backend
    _say(f"{dtype}, attention backend {backend} ({resolved})")
    hf_model = hf_timers.load_hf_model(plan.model_dir, torch_dtype)
    elem_size = torch.empty((), dtype=torch_dtype).element_size()
    subjects = Subjects(engine, hf_model, shape, elem_size, bandwidth, peak)
    prompt = measure.random_prompt(plan.prefill_len, shape.vocab_size, seed=512)
    rows = _measure_rows(plan, subjects, prompt)
    prefix_row, profiles = _prefix_hit_row(plan, subjects, dtype, backend)
    long_row, long_profiles = _long_decode_row(plan, subjects, dtype, backend)
    del subjects, hf_model  # frees the transformers model before profiling
    gc.collect()
    if backend == "auto":
        _wait_quiet(plan)
        profiles = measure.profile_missed(engine, dtype, rows, prompt, plan.prompt_len) + profiles
    profiles += long_profiles
    rows.insert(1, prefix_row)  # after the prefill from position 0
    rows.append(long_row)
    del engine
    gc.collect()
    return report.DtypeResult(dtype, peak, rows, resolved), profiles


def run(plan: BenchPlan, command: str) -> report.BenchReport:
    torch.set_num_threads(plan.num_threads)
    start = time.perf_counter()
    machine = {**machine_facts(), **measure.torch_facts(plan.num_threads)}
    _wait_quiet(plan)
    bandwidth = measure.measure_bandwidth(num_runs=plan.num_hardware_runs)
    _say(f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s (load avg {os.getloadavg()[0]:.2f})")
    shape = report.ModelShape.from_model_config(ModelConfig.from_model_dir(plan.model_dir))
    hf_attention = hf_timers.ATTN_IMPLEMENTATION
    bench_report = report.BenchReport(command, plan.quick, machine, bandwidth, hf_attention)
    peaks: dict[str, float] = {}
    for dtype, backend in plan.runs:
        result, profiles = _run_dtype(plan, dtype, backend, shape, bandwidth, peaks)
        bench_report.results.append(result)
        bench_report.profiles.extend(profiles)
    bench_report.wall_s = time.perf_counter() - start
    bench_report.load_average_end = os.getloadavg()[0]
    return bench_report


def main(args: argparse.Namespace) -> int:
    if getattr(args, "penalties", False):
        from tandem.bench.engine import penalties

        return penalties.main(args)
    if getattr(args, "attention", False):
        from tandem.bench.engine import attention

        return attention.main(args)
    if getattr(args, "step_profile", False):
        from tandem.bench.engine import step_profile

        return step_profile.main(args)
    # A full run updates the doc unless told otherwise; a quick one only when told.
    out = args.out if args.out is not None or args.quick else DEFAULT_OUT
    ensure_model(args.model, "small")
    bench_report = run(make_plan(args), args.command)
    name = "engine-quick.json" if args.quick else "engine.json"
    write_json(RESULTS_DIR / name, bench_report)
    publish(out, report.SECTION_HEADING, report.render_section(bench_report))
    return 0
