"""`tandem-bench threads`: torch threads of workers that share a node's cores.

Starts `tandem serve` (1 prefill + 1 decode worker on the CPU, KV over TCP) once per
option: `--thread-policy shared` (every worker gets all cores), `--thread-policy split`
(cores / workers) and, on nodes with 4 cores or more, 1 thread each. Each runs the same
closed-loop load (token-id prompts over gRPC); the section reports output tokens/s per
option. One server at a time, options interleaved over rounds, so that a shared
machine's drift falls on all alike.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import statistics
from pathlib import Path

from tandem.bench.harness import cpu_pair_spec, ensure_model, running
from tandem.bench.loadgen.clients import ClientConfig
from tandem.bench.loadgen.load import LoadConfig
from tandem.bench.loadgen.runner import BenchConfig, WorkloadConfig, run_benchmark
from tandem.bench.report import publish, render_table

logger = logging.getLogger(__name__)

SECTION_HEADING = "## Thread policy (1P+1D sharing a node)"


@dataclasses.dataclass(frozen=True)
class Option:
    label: str
    flags: tuple[str, ...]


def options(num_cores: int) -> list[Option]:
    """The policies, plus explicit counts the policies do not already give."""
    shared, split = num_cores, max(1, num_cores // 2)
    found = [
        Option(f"shared ({shared} threads each, default)", ("--thread-policy", "shared")),
        Option(f"split ({split} each)", ("--thread-policy", "split")),
    ]
    if split > 1:
        found.append(Option("1 thread each", ("--threads", "1")))
    return found


async def measure(option: Option, args: argparse.Namespace) -> float:
    """Output tokens/s of one server run under the load."""
    spec = cpu_pair_spec(
        f"threads {option.label}", args.model, ("--dtype", "float32", *option.flags)
    )
    assert spec.grpc_target is not None
    with running([spec], args.log_dir):
        config = BenchConfig(
            ClientConfig(spec.grpc_target, prompt_format="ids"),
            WorkloadConfig("fixed", args.input_len, args.output_len, seed=0),
            LoadConfig(concurrency=args.concurrency, num_requests=args.requests, progress=False),
            warmup_requests=2,
        )
        result = await run_benchmark(config)
    return result.summary.output_throughput_tps


def main(args: argparse.Namespace) -> int:
    args.model = ensure_model(Path(args.model), "small")
    if args.quick:
        args.requests, args.rounds = min(args.requests, 8), 1
    args.log_dir = Path("bench/results/threads")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    num_cores = os.cpu_count() or 1
    runs: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for option in options(num_cores):
            tps = asyncio.run(measure(option, args))
            logger.info("round %d %s: %.1f output tok/s", round_, option.label, tps)
            runs.setdefault(option.label, []).append(tps)
    best = max(statistics.median(v) for v in runs.values())
    rows = [
        [label, f"{statistics.median(v):.1f}", f"{statistics.median(v) / best:.0%}"]
        for label, v in runs.items()
    ]
    text = "\n".join(
        [
            f"`{args.command}`",
            "",
            f"{num_cores} cores, load average {os.getloadavg()[0]:.1f} at the end; model "
            f"`{args.model}`, float32; closed loop, concurrency {args.concurrency}, "
            f"{args.requests} requests of {args.input_len} prompt + {args.output_len} output "
            f"tokens per run; median of {args.rounds} rounds (options interleaved).",
            "",
            render_table(["option", "output tok/s", "vs best"], rows),
        ]
    )
    publish(args.out, SECTION_HEADING, [text])
    return 0
