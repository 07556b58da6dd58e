"""One table row at a time: engine, transformers and matmul floor timed side by side.

A row's three timers run interleaved (engine, transformers, floor, engine, ...), so
load from other processes hits them alike; the roofline is computed, not timed. Rows
that miss a target get an engine profile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedModel

from tandem.bench import engine_hf, engine_measure
from tandem.bench.engine_load import foreign_cores, snapshot
from tandem.bench.engine_report import MATMUL_OPS, Profile, Row, floor_target
from tandem.bench.engine_roofline import ModelShape, Roofline, decode_roofline, prefill_roofline
from tandem.bench.engine_timing import OpProfile, RepeatPolicy, median, repeat_interleaved, top_ops
from tandem.engine.llm_engine import Engine

NUM_PROFILE_STEPS = 3
NUM_PROFILE_OPS = 8


@dataclass(frozen=True)
class Subjects:
    """What one dtype's rows are measured on, and the ceilings they are held to."""

    engine: Engine
    hf_model: PreTrainedModel
    shape: ModelShape
    elem_size: int
    bandwidth: float  # bytes/s
    peak_flops: float  # FLOP/s in this dtype


def decode_max_tokens(policy: RepeatPolicy) -> int:
    """Output tokens a decode row's requests need: every warm-up and timed step, plus slack."""
    return policy.num_warmup + policy.max_runs + 2


@dataclass(frozen=True)
class _Samples:
    """Seconds per run of each timer, and how busy other processes kept the machine."""

    times: dict[str, list[float]]
    foreign_cores: float


def _timed(timers: dict[str, Callable[[], float]], policy: RepeatPolicy) -> _Samples:
    start = snapshot()
    times = repeat_interleaved(timers, policy)
    return _Samples(times, foreign_cores(start, snapshot()))


def _peak_flops(subjects: Subjects, samples: _Samples, floor_flops: float) -> float:
    """The measured GEMM peak, or the rate the model's own matmuls reached if higher.

    A square GEMM is not always the fastest shape (bf16 on AVX2 especially); a roofline
    must never ask for more than the hardware was seen to do.
    """
    return max(subjects.peak_flops, floor_flops / min(samples.times["floor"]))


def _row(
    name: str,
    kind: str,
    num_tokens: int,
    samples: _Samples,
    bound: Roofline,
    context: str = "",
) -> Row:
    times = samples.times
    return Row(
        name=name,
        kind=kind,
        num_tokens=num_tokens,
        engine_s=median(times["engine"]),
        transformers_s=median(times["transformers"]),
        floor_s=median(times["floor"]),
        roofline_s=bound.time_s,
        roofline_bound=bound.bound,
        floor_target=floor_target(kind, num_tokens),
        context=context,
        foreign_cores=samples.foreign_cores,
        samples=times,
    )


def prefill_row(subjects: Subjects, prompt: list[int], policy: RepeatPolicy) -> Row:
    engine = subjects.engine
    num_tokens = len(prompt)
    timers = {
        "engine": engine_measure.prefill_timer(engine, prompt),
        "transformers": engine_hf.hf_prefill_timer(subjects.hf_model, prompt),
        "floor": engine_measure.matmul_floor_timer(engine.runner.model, num_tokens, 1),
    }
    samples = _timed(timers, policy)
    engine_measure.expect_idle(engine)
    peak = _peak_flops(subjects, samples, subjects.shape.matmul_flops(num_tokens, 1))
    bound = prefill_roofline(
        subjects.shape, num_tokens, subjects.elem_size, subjects.bandwidth, peak
    )
    return _row(f"prefill {num_tokens}", "prefill", num_tokens, samples, bound)


def decode_row(subjects: Subjects, batch_size: int, prompt_len: int, policy: RepeatPolicy) -> Row:
    engine = subjects.engine
    max_tokens = decode_max_tokens(policy)
    with engine_measure.decode_batch(engine, batch_size, prompt_len, max_tokens) as batch:
        hf_batch = engine_hf.HfDecodeBatch(subjects.hf_model, batch_size, prompt_len)
        timers = {
            "engine": batch.step,
            "transformers": hf_batch.step,
            "floor": engine_measure.matmul_floor_timer(engine.runner.model, batch_size, batch_size),
        }
        samples = _timed(timers, policy)
        last = batch.next_context_len() - 1
    first = last - len(samples.times["engine"]) + 1
    peak = _peak_flops(subjects, samples, subjects.shape.matmul_flops(batch_size, batch_size))
    bound = decode_roofline(
        subjects.shape,
        batch_size,
        (first + last) // 2,
        subjects.elem_size,
        subjects.bandwidth,
        peak,
    )
    return _row(f"decode b{batch_size}", "decode", batch_size, samples, bound, f"{first}–{last}")


def _to_profile(dtype: str, row: Row, measured: OpProfile, num_steps: int) -> Profile:
    per_step_us = {op: us / num_steps for op, us in measured.self_times_us.items()}
    matmul_us = sum(us for op, us in per_step_us.items() if op in MATMUL_OPS)
    return Profile(
        dtype=dtype,
        row=row.name,
        num_steps=num_steps,
        wall_s=measured.wall_s / num_steps,
        op_s=sum(per_step_us.values()) / 1e6,
        matmul_s=matmul_us / 1e6,
        ops=top_ops(per_step_us, NUM_PROFILE_OPS),
    )


def profile_missed(
    engine: Engine, dtype: str, rows: list[Row], prompt: list[int], prompt_len: int
) -> list[Profile]:
    """Engine profiles of every row that misses a target (`prompt` is the prefill's)."""
    profiles = []
    for row in rows:
        if row.floor_met and row.transformers_met:
            continue
        if row.kind == "prefill":
            measured = engine_measure.profile_prefill(engine, prompt)
            profiles.append(_to_profile(dtype, row, measured, 1))
        else:
            measured = engine_measure.profile_decode(
                engine, row.num_tokens, prompt_len, NUM_PROFILE_STEPS
            )
            profiles.append(_to_profile(dtype, row, measured, NUM_PROFILE_STEPS))
    return profiles
