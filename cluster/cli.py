"""The `tandem` command line: one subcommand per entry point into the system.

    tandem model make --preset tiny|small --out DIR [--seed N]
    tandem demo --model DIR [--max-tokens N] [--prompt TEXT ...]
    tandem serve [--model DIR] [--prefill N --decode M | --colocated K] [...]

Each subcommand imports what it needs inside its handler, so `tandem model make`
works before (or without) the engine and cluster code it does not use.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Sequence

# Engine token budget per step when chunked prefill is on (`--max-num-batched-tokens`).
DEFAULT_TOKEN_BUDGET = 512

DEMO_PROMPTS = (
    "The quick brown fox",
    "Hello, my name is",
    "A cache block holds",
    "Once upon a time, the server",
)

Handler = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tandem` console script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handler: Handler = args.handler
    return handler(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_model_commands(commands)
    _add_demo_command(commands)
    _add_serve_command(commands)
    return parser


def _add_model_commands(commands: argparse._SubParsersAction) -> None:
    model = commands.add_parser("model", help="make or inspect model directories")
    model_commands = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    make = model_commands.add_parser(
        "make", help="write a random-weight Llama model directory that transformers loads"
    )
    # Presets are checked by make_model: importing it here would slow every command.
    make.add_argument("--preset", default="tiny", help="tiny (~3M params) or small (~125M)")
    make.add_argument("--out", required=True, help="output directory (created if absent)")
    make.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    make.set_defaults(handler=_run_model_make)


def _add_demo_command(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser("demo", help="generate offline with one in-process engine")
    demo.add_argument("--model", required=True, help="Hugging Face model directory")
    demo.add_argument("--max-tokens", type=int, default=32, help="tokens per completion")
    demo.add_argument(
        "--prompt",
        action="append",
        dest="prompts",
        help="a prompt (repeat for several); default: a few built-in prompts",
    )
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    demo.set_defaults(handler=_run_demo)


def _add_serve_command(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve", help="start the cluster on Ray: prefill + decode workers and the router"
    )
    serve.add_argument("--model", default="models/tandem-small", help="HF model directory")
    serve.add_argument("--prefill", type=int, default=1, help="prefill workers")
    serve.add_argument("--decode", type=int, default=1, help="decode workers")
    serve.add_argument(
        "--colocated", type=int, default=0, help="K colocated workers instead of P/D pools"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address the servers bind")
    serve.add_argument("--grpc-port", type=int, default=50051, help="public gRPC port")
    serve.add_argument("--http-port", type=int, default=8000, help="HTTP port (OpenAI API)")
    serve.add_argument("--ray-address", default=None, help="join this Ray cluster")
    serve.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    serve.add_argument("--kv-backend", default=None, help="tcp, nccl or local (default: by device)")
    serve.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    serve.add_argument("--max-model-len", type=int, default=None, help="longest prompt+output")
    serve.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="engine token budget per step [512; without chunked prefill: max model length]",
    )
    serve.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="prefill each prompt in one step (the head-of-line blocking baseline)",
    )
    serve.add_argument("--api-key", default=None, help="require this key (or TANDEM_API_KEY)")
    serve.add_argument(
        "--trace-exporter", default="none", help="OpenTelemetry exporter: none, console, otlp"
    )
    serve.add_argument(
        "--admission", default="none", help="SLO admission: none, shed (429) or queue"
    )
    serve.add_argument("--ttft-slo", type=float, default=None, help="interactive TTFT target, s")
    serve.add_argument("--itl-slo", type=float, default=None, help="interactive ITL target, s")
    serve.add_argument(
        "--max-local-prefill-tokens",
        type=int,
        default=512,
        help="longest prompt a decode worker may prefill itself (0: always disaggregate)",
    )
    serve.set_defaults(handler=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from tandem.cluster.launcher import ClusterConfig
    from tandem.cluster.serve import serve

    try:
        overrides = _engine_overrides(args)
        config = ClusterConfig(
            model_dir=args.model,
            num_prefill=0 if args.colocated else args.prefill,
            num_decode=0 if args.colocated else args.decode,
            num_colocated=args.colocated,
            host=args.host,
            grpc_port=args.grpc_port,
            http_port=args.http_port,
            ray_address=args.ray_address,
            device=args.device,
            kv_backend=args.kv_backend,
            threads_per_worker=args.threads,
            engine_overrides=overrides,
            api_key=args.api_key or os.environ.get("TANDEM_API_KEY") or None,
            trace_exporter=args.trace_exporter,
            router_overrides={
                "admission_policy": args.admission,
                "ttft_slo_s": args.ttft_slo,
                "itl_slo_s": args.itl_slo,
                "max_local_prefill_tokens": args.max_local_prefill_tokens,
            },
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(config))
    return 0


def _engine_overrides(args: argparse.Namespace) -> dict[str, object]:
    """EngineConfig fields `tandem serve` sets. Without chunked prefill the budget must
    hold a whole prompt, so it defaults to the longest one (as in vLLM)."""
    from tandem.engine.config import ModelConfig

    overrides: dict[str, object] = {"enable_chunked_prefill": not args.no_chunked_prefill}
    if args.max_model_len is not None:
        overrides["max_model_len"] = args.max_model_len
    budget = args.max_num_batched_tokens
    if budget is None and args.no_chunked_prefill:
        budget = (
            args.max_model_len or ModelConfig.from_model_dir(args.model).max_position_embeddings
        )
    overrides["max_num_batched_tokens"] = budget or DEFAULT_TOKEN_BUDGET
    return overrides


def _run_model_make(args: argparse.Namespace) -> int:
    from tandem.engine.model_maker import make_model

    started = time.perf_counter()
    try:
        out = make_model(args.preset, args.out, seed=args.seed)
    except ValueError as exc:
        print(f"tandem model make: {exc}", file=sys.stderr)
        return 2
    logging.getLogger(__name__).info("made in %.1fs", time.perf_counter() - started)
    print(out)
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    import torch

    from tandem.engine.config import EngineConfig
    from tandem.engine.generate import generate
    from tandem.engine.llm_engine import Engine
    from tandem.engine.sampling_params import SamplingParams

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    prompts = list(args.prompts or DEMO_PROMPTS)
    started = time.perf_counter()
    engine = Engine(EngineConfig(model=args.model, device=device))
    print(f"engine ready on {device} in {time.perf_counter() - started:.1f}s: {args.model}")

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    started = time.perf_counter()
    outputs = generate(engine, prompts, params)
    elapsed_s = time.perf_counter() - started

    for prompt, output in zip(prompts, outputs, strict=True):
        print(f"\nprompt:     {prompt!r}")
        print(f"completion: {output.text!r}")
        print(f"            ({len(output.token_ids)} tokens, finish: {output.finish_reason})")
    num_tokens = sum(len(output.token_ids) for output in outputs)
    print(
        f"\n{len(outputs)} requests, {num_tokens} tokens in {elapsed_s:.2f}s: "
        f"{num_tokens / max(elapsed_s, 1e-9):.1f} tokens/s (greedy, batched)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
