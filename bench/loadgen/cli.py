"""`tandem-bench run|sweep`: the load generator's command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# When neither --num-requests nor --duration is given (shared-prefix: K × M instead).
DEFAULT_NUM_REQUESTS = 100


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """`run ...` or `sweep ...` (the first argument picks the action)."""
    parser = argparse.ArgumentParser(prog=prog, description="load generator")
    actions = parser.add_subparsers(dest="bench_command", required=True, metavar="ACTION")
    run = actions.add_parser("run", help="one load level; results JSON and a table")
    _add_common_arguments(run)
    load = run.add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", type=int, help="closed loop: requests kept in flight")
    load.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    run.add_argument("--timeline-plot", default=None, help="write the ITL timeline PNG here")
    run.add_argument("--no-traces", action="store_true", help="leave per-request traces out")
    run.set_defaults(handler=run_command)

    sweep = actions.add_parser("sweep", help="several load levels; one JSON and a plot")
    _add_common_arguments(sweep)
    levels = sweep.add_mutually_exclusive_group(required=True)
    levels.add_argument("--concurrency", help="closed loop levels, e.g. 1,2,4,8")
    levels.add_argument("--rate", help="open loop rates (req/s), e.g. 1,2,4")
    sweep.add_argument("--plot", default=None, help="PNG: frontier (concurrency) or goodput (rate)")
    sweep.add_argument("--label", default=None, help="series name in the plot (default target)")
    sweep.set_defaults(handler=sweep_command)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return int(args.handler(args))


def _add_common_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument(
        "--target", required=True, help="grpc://HOST:PORT (Tandem) or http://HOST:PORT (OpenAI)"
    )
    target.add_argument("--model", default="", help="model name (default: the server's first)")
    target.add_argument("--api-key", default=None, help="HTTP bearer token")
    target.add_argument(
        "--prompt-format",
        default="ids",
        choices=("ids", "text", "auto"),
        help="prompts as token ids, as words, or ids unless the server refuses them",
    )
    target.add_argument(
        "--http-logprobs", action="store_true", help="HTTP: ask logprobs for exact token counts"
    )
    target.add_argument(
        "--strict-openai",
        action="store_true",
        help="HTTP: send only OpenAI's own fields (no ignore_eos) for servers that refuse others",
    )
    target.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    target.add_argument("--request-timeout", type=float, default=600.0, help="per request, s")

    workload = parser.add_argument_group("workload")
    workload.add_argument(
        "--workload",
        default="fixed",
        choices=("fixed", "random", "shared-prefix", "chat", "mixed"),
        help="mixed: chat plus --long-fraction long documents",
    )
    workload.add_argument(
        "--input-len",
        type=int,
        default=None,
        help="prompt tokens (shared-prefix: suffix; chat: mean) [128; chat 215]",
    )
    workload.add_argument(
        "--output-len", type=int, default=None, help="output tokens (chat: mean) [128; chat 198]"
    )
    workload.add_argument("--range-ratio", type=float, default=0.5, help="random: len·(1±r)")
    workload.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: K")
    workload.add_argument("--num-suffixes", type=int, default=8, help="shared-prefix: M")
    workload.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens")
    workload.add_argument(
        "--vocab-size", type=int, default=None, help="token ids below this [server's]"
    )
    workload.add_argument(
        "--max-model-len", type=int, default=None, help="chat: clip to this [server's]"
    )
    workload.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    workload.add_argument(
        "--inject-long-at",
        type=float,
        action="append",
        default=None,
        metavar="S",
        help="send a long prompt S seconds after the start (repeatable)",
    )
    workload.add_argument(
        "--long-input-len", type=int, default=2048, help="long prompt (mixed: document) tokens"
    )
    workload.add_argument(
        "--long-output-len", type=int, default=16, help="long prompt (mixed: document) output"
    )
    workload.add_argument(
        "--long-fraction", type=float, default=0.1, help="mixed: share of long documents"
    )

    load = parser.add_argument_group("load and results")
    load.add_argument("--num-requests", type=int, default=None, help="requests per run")
    load.add_argument("--duration", type=float, default=None, help="stop sending after S s")
    load.add_argument("--timeout", type=float, default=3600.0, help="bound on a whole run, s")
    load.add_argument("--warmup", type=int, default=1, help="unrecorded requests first")
    load.add_argument("--ttft-slo", type=float, default=None, help="TTFT target, s")
    load.add_argument("--itl-slo", type=float, default=None, help="ITL (TPOT) target, s")
    load.add_argument(
        "--long-ttft-slo", type=float, default=None, help="TTFT target of long documents, s"
    )
    load.add_argument("--out", default=None, help="write the results JSON here")
    load.add_argument("--markdown", action="store_true", help="tables as markdown")
    load.add_argument("--no-progress", action="store_true", help="no progress bar")


def _bench_config(args: argparse.Namespace, concurrency: int | None, rate: float | None) -> Any:
    from tandem.bench.loadgen.clients import ClientConfig
    from tandem.bench.loadgen.load import LoadConfig
    from tandem.bench.loadgen.metrics import SloTargets
    from tandem.bench.loadgen.runner import BenchConfig, LongPromptConfig, WorkloadConfig

    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        shared = args.workload == "shared-prefix"
        num_requests = args.num_prefixes * args.num_suffixes if shared else DEFAULT_NUM_REQUESTS
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
            temperature=args.temperature,
            request_timeout_s=args.request_timeout,
            http_logprobs=args.http_logprobs,
            strict_openai=args.strict_openai,
            api_key=args.api_key,
        ),
        workload=WorkloadConfig(
            kind=args.workload,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            num_prefixes=args.num_prefixes,
            num_suffixes=args.num_suffixes,
            prefix_len=args.prefix_len,
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


def _write_json(path: str, data: dict[str, Any]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    logger.info("results: %s", out)


def run_command(args: argparse.Namespace) -> int:
    import asyncio

    from tandem.bench.loadgen.runner import run_benchmark
    from tandem.bench.loadgen.tables import format_summary

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
        _write_json(args.out, result.to_json(include_traces=not args.no_traces))
    if args.timeline_plot:
        from tandem.bench.loadgen.plots import plot_itl_timeline

        plot_itl_timeline(result.load.traces, args.timeline_plot, title=title)
    return 0 if result.summary.num_succeeded else 1


def _levels(text: str, kind: type) -> list[Any]:
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"bad list of load levels {text!r}: {exc}") from exc


def sweep_command(args: argparse.Namespace) -> int:
    import asyncio
    from dataclasses import replace

    from tandem.bench.loadgen.runner import run_sweep, sweep_points, sweep_to_json
    from tandem.bench.loadgen.tables import format_sweep

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
        _write_json(args.out, sweep_to_json(results))
    if args.plot:
        from tandem.bench.loadgen.plots import plot_frontier, plot_goodput

        plot = plot_frontier if closed_loop else plot_goodput
        plot({args.label or args.target: points}, args.plot)
    return 0 if any(r.summary.num_succeeded for r in results) else 1
