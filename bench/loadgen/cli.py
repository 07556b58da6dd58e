"""`tandem-bench run|sweep`: the load generator's command line."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from tandem.bench.loadgen.clients import ClientConfig
from tandem.bench.loadgen.load import LoadConfig
from tandem.bench.loadgen.metrics import SloTargets
from tandem.bench.loadgen.plots import plot_frontier, plot_goodput
from tandem.bench.loadgen.runner import (
    BenchConfig,
    BenchResult,
    LongPromptConfig,
    WorkloadConfig,
    run_sweep,
    sweep_points,
    sweep_to_json,
)
from tandem.bench.loadgen.tables import format_summary, format_sweep
from tandem.bench.report import write_json

DEFAULT_NUM_REQUESTS = 100  # when neither --num-requests nor --duration is given


def main(args: argparse.Namespace) -> int:
    """`run` (one load level) or `sweep` (several, comma-separated); `tandem.bench.cli`
    parses both."""
    try:
        loads = _loads(args)
        config = _bench_config(args, loads[0])
    except ValueError as exc:
        return _fail(args.suite, exc, 2)
    try:
        results = asyncio.run(run_sweep(config, loads))
    except (ConnectionError, RuntimeError, ValueError) as exc:
        return _fail(args.suite, exc, 1)
    if args.suite == "run":
        _print_run(args, results[0])
    else:
        points = sweep_points(results)
        print(format_sweep(points, args.markdown))
        if args.plot:
            plot = plot_frontier if args.concurrency is not None else plot_goodput
            plot({args.label or args.target: points}, args.plot)
    if args.out:
        data = results[0].to_json() if args.suite == "run" else sweep_to_json(results)
        write_json(Path(args.out), data)
    return 0 if any(r.summary.num_succeeded for r in results) else 1


def _loads(args: argparse.Namespace) -> list[LoadConfig]:
    closed_loop = args.concurrency is not None
    text, kind = (args.concurrency, int) if closed_loop else (args.rate, float)
    try:
        levels = [kind(part) for part in str(text).split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"bad list of load levels {text!r}: {exc}") from exc
    if not levels:
        raise ValueError("give at least one load level")
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = DEFAULT_NUM_REQUESTS
    return [
        LoadConfig(
            int(level) if closed_loop else None, None if closed_loop else float(level),
            num_requests, args.duration, args.timeout, args.seed, not args.no_progress,
        )
        for level in levels
    ]


def _bench_config(args: argparse.Namespace, load: LoadConfig) -> BenchConfig:
    long_prompt = None
    if args.inject_long_at:
        at_s = tuple(args.inject_long_at)
        long_prompt = LongPromptConfig(at_s, args.long_input_len, args.long_output_len)
    client = ClientConfig(
        args.target, args.model, args.prompt_format, request_timeout_s=args.request_timeout,
        http_logprobs=args.http_logprobs, strict_openai=args.strict_openai,
    )  # fmt: skip
    workload = WorkloadConfig(
        args.workload, args.input_len, args.output_len, args.vocab_size, args.max_model_len,
        args.seed, args.long_fraction, args.long_input_len, args.long_output_len,
    )  # fmt: skip
    slo = SloTargets(args.ttft_slo, args.itl_slo, args.long_ttft_slo)
    return BenchConfig(client, workload, load, slo, long_prompt, warmup_requests=args.warmup)


def _print_run(args: argparse.Namespace, result: BenchResult) -> None:
    load = f"concurrency {args.concurrency}" if args.concurrency else f"rate {args.rate:g} req/s"
    title = f"{args.target} · {args.workload} · {load}"
    print(format_summary(result.summary, title, args.markdown))
    for tag, summary in result.by_tag.items():
        print("\n" + format_summary(summary, f"tag {tag!r}", args.markdown))


def _fail(command: str, exc: Exception, code: int) -> int:
    print(f"tandem-bench {command}: {exc}", file=sys.stderr)
    return code
