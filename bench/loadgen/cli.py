"""`tandem-bench run|sweep`: the load generator's command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from tandem.bench.loadgen.clients import ClientConfig
from tandem.bench.loadgen.load import LoadConfig
from tandem.bench.loadgen.metrics import SloTargets
from tandem.bench.loadgen.plots import plot_frontier, plot_goodput
from tandem.bench.loadgen.runner import (
    BenchConfig,
    LongPromptConfig,
    WorkloadConfig,
    run_benchmark,
    run_sweep,
    sweep_points,
    sweep_to_json,
)
from tandem.bench.loadgen.tables import format_summary, format_sweep
from tandem.bench.report import write_json

logger = logging.getLogger(__name__)

# When neither --num-requests nor --duration is given.
DEFAULT_NUM_REQUESTS = 100


def main(args: argparse.Namespace) -> int:
    """`run` (one load level) or `sweep` (several); `tandem.bench.cli` parses both."""
    return run_command(args) if args.suite == "run" else sweep_command(args)


def _bench_config(
    args: argparse.Namespace, concurrency: int | None, rate: float | None
) -> BenchConfig:
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = DEFAULT_NUM_REQUESTS
    long_prompt = None
    if args.inject_long_at:
        long_prompt = LongPromptConfig(
            tuple(args.inject_long_at), args.long_input_len, args.long_output_len
        )
    return BenchConfig(
        client=ClientConfig(
            target=args.target,
            model=args.model,
            prompt_format=args.prompt_format,
            request_timeout_s=args.request_timeout,
            http_logprobs=args.http_logprobs,
            strict_openai=args.strict_openai,
        ),
        workload=WorkloadConfig(
            kind=args.workload,
            input_len=args.input_len,
            output_len=args.output_len,
            vocab_size=args.vocab_size,
            max_model_len=args.max_model_len,
            seed=args.seed,
            long_fraction=args.long_fraction,
            long_input_len=args.long_input_len,
            long_output_len=args.long_output_len,
        ),
        load=LoadConfig(
            concurrency=concurrency,
            rate_rps=rate,
            num_requests=num_requests,
            duration_s=args.duration,
            timeout_s=args.timeout,
            seed=args.seed,
            progress=not args.no_progress,
        ),
        slo=SloTargets(args.ttft_slo, args.itl_slo, args.long_ttft_slo),
        long_prompt=long_prompt,
        warmup_requests=args.warmup,
    )


def _fail(command: str, exc: Exception, code: int) -> int:
    print(f"tandem-bench {command}: {exc}", file=sys.stderr)
    return code


def run_command(args: argparse.Namespace) -> int:
    try:
        config = _bench_config(args, args.concurrency, args.rate)
    except ValueError as exc:
        return _fail("run", exc, 2)
    try:
        result = asyncio.run(run_benchmark(config))
    except (ConnectionError, RuntimeError, ValueError) as exc:
        return _fail("run", exc, 1)
    load = f"concurrency {args.concurrency}" if args.concurrency else f"rate {args.rate:g} req/s"
    title = f"{args.target} · {args.workload} · {load}"
    print(format_summary(result.summary, title, args.markdown))
    for tag, summary in result.by_tag.items():
        print("\n" + format_summary(summary, f"tag {tag!r}", args.markdown))
    if args.out:
        write_json(Path(args.out), result.to_json())
    return 0 if result.summary.num_succeeded else 1


def _levels(text: str, kind: type) -> list[Any]:
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"bad list of load levels {text!r}: {exc}") from exc


def sweep_command(args: argparse.Namespace) -> int:
    try:
        closed_loop = bool(args.concurrency)
        if closed_loop:
            concurrencies = _levels(args.concurrency, int)
            config = _bench_config(args, concurrencies[0] if concurrencies else 1, None)
            loads = [replace(config.load, concurrency=c) for c in concurrencies]
        else:
            rates = _levels(args.rate, float)
            config = _bench_config(args, None, rates[0] if rates else 1.0)
            loads = [replace(config.load, rate_rps=r) for r in rates]
        if not loads:
            raise ValueError("give at least one load level")
    except ValueError as exc:
        return _fail("sweep", exc, 2)
    try:
        results = asyncio.run(run_sweep(config, loads))
    except (ConnectionError, RuntimeError, ValueError) as exc:
        return _fail("sweep", exc, 1)
    points = sweep_points(results)
    print(format_sweep(points, args.markdown))
    if args.out:
        write_json(Path(args.out), sweep_to_json(results))
    if args.plot:
        plot = plot_frontier if closed_loop else plot_goodput
        plot({args.label or args.target: points}, args.plot)
    return 0 if any(r.summary.num_succeeded for r in results) else 1
