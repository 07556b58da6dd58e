"""The `tandem` command line: one subcommand per entry point into the system.

    tandem model make --preset tiny|small --out DIR [--seed N]
    tandem demo --model DIR [--max-tokens N] [--prompt TEXT ...]
    tandem serve [--model DIR] [--prefill N --decode M | --colocated K] [...]
    tandem pools | scale | router ...   (see cluster.pool_commands)
    tandem profile | plan ...            (see planner.profile_cli, planner.plan_cli)

Each subcommand imports what it needs inside its handler, so `tandem model make`
works before (or without) the engine and cluster code it does not use.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from tandem.cluster.config import ClusterConfig

DEMO_PROMPTS = (
    "The quick brown fox",
    "Hello, my name is",
    "A cache block holds",
    "Once upon a time, the server",
)

Handler = Callable[[argparse.Namespace], int]
_T = TypeVar("_T")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tandem` console script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # `kill -USR1 PID` writes every thread's stack to stderr (a stuck server, a slow stop).
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__ or sys.stderr, all_threads=True)
    handler: Handler = args.handler
    try:
        return handler(args)
    except BrokenPipeError:
        # The reader of our output left (`tandem pools | head`): end quietly, as a
        # command killed by SIGPIPE does. Python would print a traceback flushing stdout.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_model_commands(commands)
    _add_demo_command(commands)
    _add_serve_command(commands)
    from tandem.cluster.pool_commands import add_pool_commands

    add_pool_commands(commands)
    from tandem.planner.plan_cli import add_plan_command
    from tandem.planner.profile_cli import add_profile_command

    add_profile_command(commands)
    add_plan_command(commands)
    return parser


def _add_model_commands(commands: argparse._SubParsersAction) -> None:
    model = commands.add_parser("model", help="make a model directory")
    model_commands = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    make = model_commands.add_parser(
        "make", help="write a random-weight Llama model directory that transformers loads"
    )
    # Presets are checked by make_model: importing it here would slow every command.
    make.add_argument("--preset", default="tiny", help="tiny (~3M params) or small (~125M)")
    make.add_argument("--out", required=True, help="output directory (created if absent)")
    make.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    make.set_defaults(handler=_run_model_make)


DTYPE_HELP = (
    "weights and KV: auto = the checkpoint's on CUDA; on CPU bfloat16 where the CPU has bf16 "
    "GEMM instructions (AMX or AVX512-BF16), else float32 [auto]"
)


def _add_demo_command(commands: argparse._SubParsersAction) -> None:
    from tandem.engine.config import DeviceKind
    from tandem.engine.dtype import DTYPE_CHOICES

    demo = commands.add_parser("demo", help="generate offline with one in-process engine")
    demo.add_argument("--model", required=True, help="Hugging Face model directory")
    demo.add_argument("--max-tokens", type=int, default=32, help="tokens per completion")
    demo.add_argument(
        "--prompt",
        action="append",
        dest="prompts",
        help="a prompt (repeat for several); default: a few built-in prompts",
    )
    demo.add_argument(
        "--device", choices=[d.value for d in DeviceKind], default=None,
        help="[cuda if present, else cpu]",
    )  # fmt: skip
    demo.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=DTYPE_HELP)
    add_kv_cache_memory_flag(demo)
    add_attention_backend_flag(demo)
    add_cuda_graphs_flag(demo)
    demo.set_defaults(handler=_run_demo, demo_parser=demo)


def add_attention_backend_flag(parser: argparse.ArgumentParser) -> None:
    from tandem.engine.attention import AttentionBackendName

    parser.add_argument(
        "--attention-backend", choices=[b.value for b in AttentionBackendName], default="auto",
        help="attention kernels: triton (CUDA; CPU only under TRITON_INTERPRET=1), cpu (a C++ "
        "paged decode op, built once per machine) or the torch reference [auto: triton on "
        "cuda, cpu on cpu where its op builds]",
    )  # fmt: skip


def add_cuda_graphs_flag(parser: argparse.ArgumentParser) -> None:
    from tandem.engine.cuda_graphs import CudaGraphMode

    parser.add_argument(
        "--cuda-graphs", choices=[m.value for m in CudaGraphMode], default="auto",
        help="replay CUDA graphs for decode steps (needs cuda and the triton attention "
        "backend; off = always eager) [auto: on where it can run]",
    )  # fmt: skip


def _int_at_least(minimum: int, text: str) -> int:
    """An argparse integer >= `minimum`, or ArgumentTypeError saying what was wrong."""
    try:
        value = int(text)
    except ValueError:
        message = f"expected an integer >= {minimum}, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(1, text)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(0, text)


def port(text: str) -> int:
    """argparse type: a TCP port (0 picks a free one)."""
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (seconds)."""
    value = _finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (seconds)."""
    value = _finite_float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {value}")
    return value


def non_empty(text: str) -> str:
    """argparse type: a string with something in it."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


# Units of `byte_size`: Kubernetes quantities (decimal K/M/G/T, binary Ki/Mi/Gi/Ti), each
# also with a trailing B (GB, GiB), as Helm values and operators write them.
_BYTE_UNITS = {
    "": 1,
    **{p: 1000**i for i, p in enumerate("KMGT", start=1)},
    **{p + "i": 1024**i for i, p in enumerate("KMGT", start=1)},
}
_BYTE_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?)?B?\s*", re.IGNORECASE)


def byte_size(text: str) -> int:
    """argparse type: a size in bytes >= 1, plain or with a unit (512MiB, 4Gi, 2GB)."""
    match = _BYTE_SIZE.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected bytes or a size like 512MiB, 4GiB, 2GB, got {text!r}"
        )
    unit = (match[2] or "").upper().replace("I", "i")
    value = int(float(match[1]) * _BYTE_UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def add_kv_cache_memory_flag(parser: argparse.ArgumentParser) -> None:
    from tandem.engine.config import EngineConfig

    default_gib = EngineConfig.kv_cache_memory_bytes / (1 << 30)
    parser.add_argument(
        "--kv-cache-memory", type=byte_size, default=None,
        help="KV cache of each engine, in bytes or with a unit (512MiB, 4GiB); it must hold "
        f"one max-model-len sequence [{default_gib:g}GiB]",
    )  # fmt: skip


def _add_serve_command(commands: argparse._SubParsersAction) -> None:
    # Defaults shown in help come from the config classes (argparse default None means
    # "the config's default"), so each is defined once.
    from tandem.cluster.config import PoolsConfig, RayConfig, ThreadPolicy
    from tandem.cluster.security_flags import add_security_flags
    from tandem.engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DeviceKind
    from tandem.engine.dtype import DTYPE_CHOICES
    from tandem.router.config import DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, RouterConfig
    from tandem.router.policy import AdmissionPolicy
    from tandem.router.sampling_defaults import GenerationConfigUse
    from tandem.telemetry.tracing import TraceExporter
    from tandem.worker.config import DEFAULT_HOST, KvBackend, WorkerSettings

    pools, router = PoolsConfig(), RouterConfig.__dataclass_fields__
    serve = commands.add_parser(
        "serve", help="start the cluster on Ray: prefill + decode workers and the router"
    )
    serve.add_argument("--model", default="models/tandem-small", help="HF model directory")
    serve.add_argument(
        "--prefill", type=positive_int, default=None,
        help=f"prefill workers [{pools.num_prefill}]",
    )  # fmt: skip
    serve.add_argument(
        "--decode", type=positive_int, default=None, help=f"decode workers [{pools.num_decode}]"
    )
    serve.add_argument(
        "--colocated", type=positive_int, default=None,
        help="K colocated workers instead of the prefill/decode pools",
    )  # fmt: skip
    serve.add_argument("--host", default=None, help=f"address the servers bind [{DEFAULT_HOST}]")
    serve.add_argument(
        "--grpc-port", type=port, default=None, help=f"public gRPC port [{DEFAULT_GRPC_PORT}]"
    )
    serve.add_argument(
        "--http-port", type=port, default=None,
        help=f"HTTP port (OpenAI API) [{DEFAULT_HTTP_PORT}]",
    )  # fmt: skip
    serve.add_argument("--ray-address", default=None, help="join this Ray cluster")
    serve.add_argument(
        "--gpus-per-worker", type=float, default=None,
        help="GPUs each worker asks Ray for with --device cuda; a fraction lets workers "
        f"share one GPU (then KV moves by cuda_ipc) [{RayConfig.gpus_per_worker}]",
    )  # fmt: skip
    serve.add_argument(
        "--device", choices=[d.value for d in DeviceKind], default=None,
        help="where the engines run [cuda if present, else cpu]",
    )  # fmt: skip
    add_attention_backend_flag(serve)
    add_cuda_graphs_flag(serve)
    # `local` is in-process only (tests, benchmarks): a cluster's workers are processes.
    serve.add_argument(
        "--kv-backend", choices=[b.value for b in KvBackend if b is not KvBackend.LOCAL],
        default=None,
        help="KV transfer between workers: auto = per worker pair, cuda_ipc on one node "
        "(different processes), nccl between nodes, tcp on cpu [auto]",
    )  # fmt: skip
    serve.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=DTYPE_HELP)
    serve.add_argument(
        "--thread-policy", choices=[p.value for p in ThreadPolicy], default=None,
        help="torch threads per worker without --threads: shared = all cores each, split = "
        f"cores / workers [{RayConfig.thread_policy}]",
    )  # fmt: skip
    serve.add_argument(
        "--threads", type=positive_int, default=None,
        help="torch threads per worker [from --thread-policy]",
    )  # fmt: skip
    serve.add_argument(
        "--max-model-len", type=positive_int, default=None,
        help="longest prompt+output [the model's max_position_embeddings]",
    )  # fmt: skip
    serve.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        help=f"engine token budget per step [{DEFAULT_MAX_NUM_BATCHED_TOKENS}; "
        "without chunked prefill: max model length]",
    )
    add_kv_cache_memory_flag(serve)
    serve.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="prefill each prompt in one step (the head-of-line blocking baseline)",
    )
    serve.add_argument(
        "--step-watchdog", type=positive_float, default=None,
        help="seconds one engine step may run before its worker counts as hung and is "
        f"replaced [{WorkerSettings.step_watchdog_s:.0f}]",
    )  # fmt: skip
    serve.add_argument(
        "--api-key", default=None,
        help="require this key on every public API, HTTP and gRPC (or TANDEM_API_KEY)",
    )  # fmt: skip
    serve.add_argument(
        "--max-n", type=positive_int, default=None,
        help=f"most choices (n) one OpenAI request may ask for [{router['max_n'].default}]",
    )  # fmt: skip
    serve.add_argument(
        "--generation-config", choices=[u.value for u in GenerationConfigUse], default=None,
        help="auto: the sampling defaults the model's generation_config.json names "
        "(temperature, top_p, top_k, min_p, repetition_penalty) apply to requests that "
        "leave them out, as vLLM; off: OpenAI's defaults "
        f"[{router['generation_config'].default.value}]",
    )  # fmt: skip
    serve.add_argument(
        "--trace-exporter", choices=[e.value for e in TraceExporter], default=None,
        help=f"OpenTelemetry exporter [{router['trace_exporter'].default}]",
    )  # fmt: skip
    serve.add_argument(
        "--admission", choices=[p.value for p in AdmissionPolicy], default=None,
        help=f"SLO admission: none, shed (429) or queue [{router['admission_policy'].default}]",
    )  # fmt: skip
    serve.add_argument(
        "--ttft-slo", type=positive_float, default=None, help="interactive TTFT target, s"
    )
    serve.add_argument(
        "--itl-slo", type=positive_float, default=None, help="interactive ITL target, s"
    )
    serve.add_argument(
        "--max-local-prefill-tokens",
        type=non_negative_int,
        default=None,
        help="longest prompt a decode worker may prefill itself (0: always disaggregate) "
        f"[{router['max_local_prefill_tokens'].default}]",
    )
    serve.add_argument(
        "--max-workers-per-role", type=positive_int, default=None,
        help=f"the most workers `tandem scale` may ask of one role [{pools.max_workers_per_role}]",
    )  # fmt: skip
    serve.add_argument(
        "--restart-backoff", type=non_negative_float, default=None,
        help="seconds a role's next start waits after its second worker in a row died young, "
        f"doubling up to {pools.restart_backoff_max_s:g} s (0: restart at once) "
        f"[{pools.restart_backoff_s:g}]",
    )  # fmt: skip
    serve.add_argument(
        "--autoscaling", action="store_true",
        help="the Ray cluster adds nodes on demand: workers ask for tandem_<role> resources "
        "and targets are not checked against the nodes there now",
    )  # fmt: skip
    serve.add_argument(
        "--pool-metrics-port", type=port, default=None,
        help="port of the pool controller's /metrics (0: a free one) "
        f"[{pools.metrics_port}]",
    )  # fmt: skip
    from tandem.planner.live_config import DEFAULT_PLANNER_INTERVAL_S, PlannerMode

    serve.add_argument(
        "--planner", choices=[m.value for m in PlannerMode], default=PlannerMode.OBSERVE.value,
        help="live P:D planner: off, observe (recommend) or auto (resize the pools) [observe]",
    )  # fmt: skip
    serve.add_argument(
        "--planner-interval", type=positive_float, default=DEFAULT_PLANNER_INTERVAL_S,
        help=f"seconds between plans [{DEFAULT_PLANNER_INTERVAL_S:g}]",
    )  # fmt: skip
    serve.add_argument(
        "--max-workers", type=positive_int, default=None,
        help="the planner's worker budget, a cap [the pools' size, following tandem scale]",
    )  # fmt: skip
    add_security_flags(serve, generates_token=True)
    serve.set_defaults(handler=_run_serve, serve_parser=serve)


def _run_serve(args: argparse.Namespace) -> int:
    import asyncio

    from tandem.cluster.pool_commands import ray_auth_env

    if args.ray_address:
        ray_auth_env()  # before Ray is imported: it reads the auth mode then
    from tandem.cluster.serve import serve
    from tandem.router.ports import PortInUse

    try:
        config = cluster_config_from_args(args)
    except CliError as exc:
        args.serve_parser.error(str(exc))  # usage + message on stderr, exit status 2
    try:
        asyncio.run(serve(config))
    except (ConnectionError, PortInUse) as exc:  # ConnectionError: no Ray at --ray-address
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 1
    return 0


class CliError(ValueError):
    """A `tandem serve` flag combination (or value) the cluster cannot run."""


def cluster_config_from_args(args: argparse.Namespace) -> ClusterConfig:
    """The typed cluster tree `tandem serve` runs; CliError names what is wrong. Flags
    left out (None) keep the config classes' defaults."""
    import os

    import torch

    from tandem.cluster.config import ClusterConfig, PoolsConfig, RayConfig, ThreadPolicy
    from tandem.cluster.security_flags import cluster_auth_from_args, server_api_key
    from tandem.engine.config import DeviceKind, EngineConfig, default_device
    from tandem.planner.live_config import PlannerConfig, PlannerMode
    from tandem.router.config import RouterConfig
    from tandem.router.sampling_defaults import SamplingDefaults
    from tandem.worker.config import WorkerSettings

    if args.colocated is not None and (args.prefill is not None or args.decode is not None):
        raise CliError("--colocated replaces the --prefill/--decode pools; give one or the other")
    if args.device == DeviceKind.CUDA and not torch.cuda.is_available():
        raise CliError("--device cuda: this machine has no CUDA device (use --device cpu)")
    device = DeviceKind(args.device) if args.device else default_device()
    if args.kv_backend in ("nccl", "cuda_ipc") and device is not DeviceKind.CUDA:
        raise CliError(
            f"--kv-backend {args.kv_backend} moves KV between GPUs; with --device cpu use tcp"
        )
    try:
        api_key = server_api_key(args.api_key)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        limit = _flag(args.max_workers_per_role, PoolsConfig.max_workers_per_role)
        limits = {
            "max_workers_per_role": limit,
            "metrics_port": _flag(args.pool_metrics_port, PoolsConfig.metrics_port),
            "restart_backoff_s": _flag(args.restart_backoff, PoolsConfig.restart_backoff_s),
        }
        pools = (
            PoolsConfig(num_prefill=0, num_decode=0, num_colocated=args.colocated, **limits)
            if args.colocated is not None
            else PoolsConfig(
                num_prefill=_flag(args.prefill, PoolsConfig.num_prefill),
                num_decode=_flag(args.decode, PoolsConfig.num_decode),
                **limits,
            )
        )
        # A flag left out (None) is these fields' own default: derived by the engine (or
        # torch's thread count).
        engine = EngineConfig(
            model=args.model,
            device=device,
            enable_chunked_prefill=not args.no_chunked_prefill,
            num_threads=args.threads,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_bytes=_flag(args.kv_cache_memory, EngineConfig.kv_cache_memory_bytes),
            attention_backend=args.attention_backend,
            cuda_graphs=args.cuda_graphs,
        )
        # One token for the whole cluster: the workers check it, the router presents it.
        auth = cluster_auth_from_args(args, os.environ, generate=True)
        # --host and --trace-exporter apply to the workers and the router alike.
        worker = WorkerSettings(
            host=_flag(args.host, WorkerSettings.host),
            trace_exporter=_flag(args.trace_exporter, WorkerSettings.trace_exporter),
            kv_backend=args.kv_backend,
            step_watchdog_s=_flag(args.step_watchdog, WorkerSettings.step_watchdog_s),
            cluster_auth=auth,
        )
        router = RouterConfig(
            model_dir=args.model,
            api_key=api_key,
            cluster_auth=auth,
            host=_flag(args.host, RouterConfig.host),
            trace_exporter=_flag(args.trace_exporter, RouterConfig.trace_exporter),
            grpc_port=_flag(args.grpc_port, RouterConfig.grpc_port),
            http_port=_flag(args.http_port, RouterConfig.http_port),
            admission_policy=_flag(args.admission, RouterConfig.admission_policy),
            ttft_slo_s=args.ttft_slo,
            itl_slo_s=args.itl_slo,
            max_local_prefill_tokens=_flag(
                args.max_local_prefill_tokens, RouterConfig.max_local_prefill_tokens
            ),
            max_n=_flag(args.max_n, RouterConfig.max_n),
            generation_config=_flag(args.generation_config, RouterConfig.generation_config),
        )
        # Its generation_config.json read now: a bad one is refused before any worker starts.
        SamplingDefaults.of_model(router.model_dir, router.generation_config)
        return ClusterConfig(
            model_dir=args.model,
            pools=pools,
            engine=engine,
            worker=worker,
            router=router,
            ray=RayConfig(
                address=args.ray_address,
                autoscaling=args.autoscaling,
                role_resources=True if args.autoscaling else None,
                thread_policy=ThreadPolicy(_flag(args.thread_policy, RayConfig.thread_policy)),
                gpus_per_worker=_flag(args.gpus_per_worker, RayConfig.gpus_per_worker),
            ),
            planner=PlannerConfig(
                mode=PlannerMode(args.planner),
                interval_s=args.planner_interval,
                max_workers=args.max_workers,
            ),
        )
    except (ValueError, FileNotFoundError) as exc:
        raise CliError(_in_flag_terms(str(exc))) from exc


# Config fields a `tandem serve` flag sets, as the config classes' errors name them.
_FLAGS_OF_FIELDS = {
    "planner.max_workers": "--max-workers",
    "pools.max_workers_per_role": "--max-workers-per-role",
    "max_workers_per_role": "--max-workers-per-role",
    "pools.num_prefill": "--prefill",
    "pools.num_decode": "--decode",
    "pools.num_colocated": "--colocated",
    "pools.metrics_port": "--pool-metrics-port",
}
_FIELD_NAMES = re.compile(
    r"(?<![\w.-])("
    + "|".join(re.escape(f) for f in sorted(_FLAGS_OF_FIELDS, key=len, reverse=True))
    + r")\b"
)


def _in_flag_terms(message: str) -> str:
    """A config error as the command line says it: "planner.max_workers must be >= 2"
    becomes "--max-workers must be >= 2"."""
    return _FIELD_NAMES.sub(lambda match: _FLAGS_OF_FIELDS[match.group(1)], message)


def _flag(value: _T | None, default: _T) -> _T:
    """A flag's value, or `default` (the config class's own) when the flag was left out."""
    return default if value is None else value


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
    from tandem.engine.dtype import dtype_banner
    from tandem.engine.generate import generate
    from tandem.engine.llm_engine import Engine
    from tandem.engine.sampling_params import SamplingParams

    if args.device == "cuda" and not torch.cuda.is_available():
        args.demo_parser.error("--device cuda: this machine has no CUDA device (use --device cpu)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    prompts = list(args.prompts or DEMO_PROMPTS)
    started = time.perf_counter()
    try:
        config = EngineConfig(
            model=args.model,
            device=device,
            dtype=args.dtype,
            kv_cache_memory_bytes=_flag(args.kv_cache_memory, EngineConfig.kv_cache_memory_bytes),
            attention_backend=args.attention_backend,
            cuda_graphs=args.cuda_graphs,
        )
        engine = Engine(config)
    except (ValueError, FileNotFoundError) as exc:
        args.demo_parser.error(str(exc))
    print(
        f"engine ready on {device}, {dtype_banner(engine.config)}, "
        f"attention {config.resolved_attention_backend}, "
        f"cuda graphs {'on' if config.use_cuda_graphs else 'off'}, in "
        f"{time.perf_counter() - started:.1f}s: {args.model}"
    )

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
