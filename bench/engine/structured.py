"""`tandem-bench structured`: what a JSON-schema constraint costs per output token.

One colocated engine; for each batch size, the same decode steps with and without a JSON
schema on every request (the schema asks for a long array of small objects, so the
grammar is still mid-output when timing ends). TPOT = wall time of the timed decode
steps / steps, median over repeats; the difference is the grammar's mask fill, mask
apply and matcher advance (compilation is warmed up first and not timed).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from tandem.bench.harness import ensure_model
from tandem.bench.report import format_ms, machine_facts, publish, render_table, run_block
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import Engine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured.spec import GuidedDecoding

HEADING = "## Cost of structured outputs"
FULL_COMMAND = "tandem-bench structured --model models/tandem-small"
PROMPT = "the cache block decode worker router latency is the"
# Long enough that no timed step reaches the end of the grammar.
SCHEMA = {
    "type": "array",
    "minItems": 64,
    "maxItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
}


def measure_tpot(
    engine: Engine, batch_size: int, num_steps: int, structured: GuidedDecoding | None
) -> float:
    """Seconds per decode step of `batch_size` requests (all past their first token)."""
    params = SamplingParams(
        max_tokens=num_steps + 4, temperature=1.0, seed=0, ignore_eos=True, structured=structured
    )
    ids = [f"r{i}" for i in range(batch_size)]
    for req_id in ids:
        engine.add_request(req_id, PROMPT, params)
    started: set[str] = set()
    while len(started) < batch_size:
        started |= {out.req_id for out in engine.step()}
    begin = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    elapsed = time.perf_counter() - begin
    for req_id in ids:
        engine.abort(req_id)
    return elapsed / num_steps


def main(args: argparse.Namespace) -> int:
    model_dir = ensure_model(Path(args.model), "tiny" if args.quick else "small")
    num_steps, repeats = (8, 2) if args.quick else (64, 5)
    torch.set_num_threads(2)
    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=1024))
    guided = GuidedDecoding.json_schema(SCHEMA)
    began = time.perf_counter()
    measure_tpot(engine, 1, 2, guided)  # compile the grammar, warm everything up
    rows = []
    for batch_size in (1, 8):
        free, constrained = [], []
        for _ in range(repeats):
            free.append(measure_tpot(engine, batch_size, num_steps, None))
            constrained.append(measure_tpot(engine, batch_size, num_steps, guided))
        free_s, json_s = statistics.median(free), statistics.median(constrained)
        rows.append(
            [
                str(batch_size),
                format_ms(free_s),
                format_ms(json_s),
                f"{100 * (json_s - free_s) / free_s:+.1f} %",
            ]
        )
    table = render_table(["batch", "TPOT free", "TPOT JSON schema", "cost"], rows)
    facts = machine_facts()
    machine = f"Machine: {facts.get('cpu', 'unknown CPU')}, {facts.get('cores', '?')} cores."
    note = (
        f"Colocated engine, model `{model_dir.name}`, float32, 2 threads; {num_steps} timed "
        f"decode steps, median of {repeats}; xgrammar mask fill + apply + advance included."
    )
    blocks = [
        run_block(FULL_COMMAND, args.command, time.perf_counter() - began, machine),
        note,
        table,
    ]
    publish(args.out, HEADING, blocks, write=not args.quick)
    return 0
