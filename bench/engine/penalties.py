"""`tandem-bench engine --penalties`: what penalties and logit_bias cost per decode step.

TPOT (one engine step of a decoding batch) with plain greedy sampling against the same
batch with presence, frequency and repetition penalties plus a 16-entry logit_bias, at
batch 1 and 8. Each round decodes a fresh batch of each variant for `steps` steps, one
variant after the other, so load from other processes skews both alike; the result is
the median over rounds of each round's median step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.bench.engine import measure
from tandem.bench.harness import ensure_model
from tandem.bench.report import (
    format_ms,
    machine_facts,
    machine_sentence,
    publish,
    render_table,
    write_json,
)
from tandem.engine.llm_engine import Engine
from tandem.engine.sampling_params import SamplingParams

SECTION_HEADING = "## Cost of sampling penalties"
RESULTS_PATH = Path("bench/results/penalties.json")
FULL_COMMAND = "tandem-bench engine --penalties --model models/tandem-small"
BATCH_SIZES = (1, 8)
PROMPT_LEN = 128
NUM_THREADS = 2
VARIANTS = {
    "plain": {},
    "penalties": {
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.2,
        "logit_bias": {token_id: -5.0 for token_id in range(100, 116)},
    },
}


@dataclass
class PenaltyRow:
    batch_size: int
    # Median seconds per decode step, by variant name.
    tpot_s: dict[str, float] = field(default_factory=dict)

    @property
    def overhead(self) -> float:
        return self.tpot_s["penalties"] / self.tpot_s["plain"] - 1.0


@dataclass
class PenaltyReport:
    command: str
    quick: bool
    machine: dict
    steps: int
    rounds: int
    rows: list[PenaltyRow] = field(default_factory=list)
    wall_s: float = 0.0


def time_round(engine: Engine, batch_size: int, steps: int, settings: dict, tag: str) -> float:
    """Median step time of a fresh batch decoding `steps` tokens with `settings`."""
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True, **settings)
    vocab = engine.model_config.vocab_size
    req_ids = [f"{tag}-{i}" for i in range(batch_size)]
    try:
        for i, req_id in enumerate(req_ids):
            prompt = measure.random_prompt(PROMPT_LEN, vocab, seed=i)
            if engine.reserve_import(req_id, prompt, prompt[0], params) is None:
                raise RuntimeError(f"KV pool too small for a batch of {batch_size}")
            engine.commit_import(req_id)
        batch = measure.DecodeBatch(engine, batch_size)
        return statistics.median(batch.step() for _ in range(steps))
    finally:
        for req_id in req_ids:
            engine.abort(req_id)
        measure.expect_idle(engine)


def run(model_dir: str, steps: int, rounds: int, quick: bool, command: str) -> PenaltyReport:
    torch.set_num_threads(NUM_THREADS)
    started = time.perf_counter()
    engine = measure.build_engine(
        model_dir, "float32", NUM_THREADS, PROMPT_LEN, max(BATCH_SIZES), PROMPT_LEN + steps + 2
    )
    result = PenaltyReport(command, quick, machine_facts(), steps, rounds)
    for batch_size in BATCH_SIZES:
        samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
        time_round(engine, batch_size, 2, VARIANTS["penalties"], "warmup")
        for number in range(rounds):
            for name, settings in VARIANTS.items():
                tag = f"b{batch_size}-r{number}-{name}"
                samples[name].append(time_round(engine, batch_size, steps, settings, tag))
        row = PenaltyRow(batch_size, {k: statistics.median(v) for k, v in samples.items()})
        print(
            f"batch {batch_size}: plain {format_ms(row.tpot_s['plain'])}, penalties "
            f"{format_ms(row.tpot_s['penalties'])} ({row.overhead:+.1%})",
            flush=True,
        )
        result.rows.append(row)
    result.wall_s = time.perf_counter() - started
    return result


def render_section(result: PenaltyReport) -> list[str]:
    header = ["batch", "TPOT plain", "TPOT with penalties + logit_bias", "overhead"]
    rows = [
        [
            str(row.batch_size),
            format_ms(row.tpot_s["plain"]),
            format_ms(row.tpot_s["penalties"]),
            f"{row.overhead:+.1%}",
        ]
        for row in result.rows
    ]
    quick = " (`--quick`: a smoke run, not a measurement)" if result.quick else ""
    text = (
        f"Command: `{FULL_COMMAND}`. This run: `{result.command}`{quick}, "
        f"{result.wall_s / 60:.1f} min.\n\n"
        f"{machine_sentence(result.machine, os.getloadavg())}\n\n"
        f"Engine decode steps (float32, {NUM_THREADS} torch threads, {PROMPT_LEN}-token "
        f"prompts, prefix caching off); median over {result.rounds} rounds of each "
        f"round's median over {result.steps} steps. Penalties: presence 0.5, frequency "
        "0.5, repetition 1.2, and 16 logit_bias entries.\n\n" + render_table(header, rows)
    )
    return [text]


def main(args: argparse.Namespace) -> int:
    out = args.out if args.out is not None or args.quick else "docs/benchmarks.md"
    ensure_model(args.model, "small")
    steps, rounds = (4, 2) if args.quick else (32, 7)
    result = run(str(args.model), steps, rounds, bool(args.quick), args.command)
    write_json(RESULTS_PATH.with_stem("penalties-quick") if args.quick else RESULTS_PATH, result)
    publish(out, SECTION_HEADING, render_section(result))
    return 0
