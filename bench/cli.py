"""`tandem-bench`: one command line for every benchmark suite (the product never imports it).

    tandem-bench engine [--quick] [--out docs/benchmarks.md]      # engine vs floor, roofline, HF
    tandem-bench kv-transfer [--model DIR]                        # KV transfer vs raw TCP
    tandem-bench router [--quick]                                 # router overhead
    tandem-bench slo [--quick]                                    # SLO admission under overload
    tandem-bench experiment all|head-of-line|frontier|goodput    # the published experiments
    tandem-bench run|sweep --target grpc://HOST:PORT|http://HOST:PORT [...]  # load generator

`tandem-bench SUITE --help` lists a suite's options. A suite's module (`main(args) -> int`)
is imported only once it is chosen, so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# suite -> (module with `main(args: argparse.Namespace) -> int`, summary)
SUITES = {
    "engine": ("engine.bench", "the engine against its matmul floor, the roofline and HF"),
    "kv-transfer": ("kv_transfer.bench", "KV transfer pulls against raw TCP"),
    "router": ("router.overhead", "router overhead: added latency and one core's throughput"),
    "slo": ("router.slo", "SLO admission under overload: shed vs admit everything"),
    "experiment": ("experiments.cli", "a published experiment: servers, load, plots, section"),
    "run": ("loadgen.cli", "load generator: one load level"),
    "sweep": ("loadgen.cli", "load generator: several levels"),
}
DOC = "docs/benchmarks.md"
# What `--quick` shortens (the engine's quick plan is its own, see `engine.bench.make_plan`).
QUICK = {
    "router": {"requests": 20, "warmup": 2, "duration": 3.0},
    "slo": {"duration": 8.0, "probe_duration": 4.0, "max_probes": 3, "probe_requests": 5},
}


# Options per suite as (flags, `add_argument` keywords).
Option = tuple[tuple[str, ...], dict[str, Any]]
_MODEL = ("--model",)
_OUT: Option = (("--out",), {"default": DOC, "help": "markdown file to update; '' = print only"})
_QUICK: Option = (("--quick",), {"action": "store_true", "help": "smoke run: checks the plumbing"})


def _model(default: str | None) -> Option:
    return _MODEL, {"type": Path, "default": default and Path(default), "help": "model directory"}


OPTIONS: dict[str, list[Option]] = {
    # A full engine run writes docs/benchmarks.md unless told otherwise, so --out is None.
    "engine": [_model("models/tandem-small"), (("--out",), {**_OUT[1], "default": None}), _QUICK],
    "kv-transfer": [
        _model("models/tandem-small"), _OUT,
        (("--repeats",), {"type": int, "default": 15, "help": "rounds of every variant"}),
        (("--prefill-tokens-per-s",), {"type": float, "help": "else measured"}),
    ],
    "router": [
        _model("models/tandem-tiny"), _OUT, _QUICK,
        (("--json",), {"type": Path, "default": Path("bench/results/router.json")}),
        (("--requests",), {"type": int, "default": 200, "help": "sequential requests per path"}),
        (("--warmup",), {"type": int, "default": 10}),
        (("--max-tokens",), {"type": int, "default": 4}),
        (("--concurrency",), {"type": int, "nargs": "+", "default": [16, 64]}),
        (("--duration",), {"type": float, "default": 10.0, "help": "seconds per level"}),
    ],
    "slo": [
        (("--preset",), {"default": "small", "choices": ["tiny", "small"]}),
        (_MODEL, {"type": Path, "help": "default: models/tandem-<preset>"}), _OUT, _QUICK,
        (("--json",), {"type": Path, "default": Path("bench/results/slo.json")}),
        # Short outputs: here decode shares the 2 cores with prefill, and long decodes
        # would slow prefill down in a way no router can see (GPUs are not shared).
        (("--max-tokens",), {"type": int, "default": 2}),
        (("--ttft-multiple",), {"type": float, "default": 3.0, "help": "target / unloaded p50"}),
        (("--overload",), {"type": float, "default": 2.0, "help": "offered / capacity"}),
        (("--duration",), {"type": float, "default": 40.0, "help": "seconds of arrivals"}),
        (("--seed",), {"type": int, "default": 0}),
    ],
    "experiment": [
        (("name",), {"choices": ("head-of-line", "frontier", "goodput", "all")}),
        _model("models/tandem-small"), _QUICK,
        (("--doc",), {"default": DOC, "help": "report to update; '' = none"}),
        (("--img-dir",), {"type": Path, "default": Path("docs/img"), "help": "plots"}),
        (("--results-dir",), {"type": Path, "default": Path("bench/results/experiments")}),
    ],
}  # fmt: skip
# Not options: fixed settings of the SLO suite's capacity probes (`--quick` shortens them).
DEFAULTS = {"slo": {"probe_duration": 10.0, "probe_requests": 30, "max_probes": 7,
                    "probe_step": 1.3}}  # fmt: skip


def _load_options(parser: argparse.ArgumentParser, sweep: bool) -> None:
    """The load generator's options, shared by `run` and `sweep`."""
    target = parser.add_argument_group("target")
    target.add_argument(
        "--target", required=True, help="grpc://HOST:PORT (Tandem) or http://HOST:PORT (OpenAI)"
    )
    target.add_argument("--model", default="", help="model name (default: the server's first)")
    target.add_argument("--prompt-format", default="ids", choices=("ids", "text"))
    target.add_argument(
        "--http-logprobs", action="store_true", help="HTTP: ask logprobs for exact token counts"
    )
    target.add_argument(
        "--strict-openai", action="store_true", help="HTTP: send only OpenAI's own fields"
    )
    target.add_argument("--request-timeout", type=float, default=600.0, help="per request, s")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--workload", default="fixed", choices=("fixed", "chat", "mixed"))
    workload.add_argument("--input-len", type=int, help="prompt tokens (chat: mean) [128; 215]")
    workload.add_argument("--output-len", type=int, help="output tokens (chat: mean) [128; 198]")
    workload.add_argument("--vocab-size", type=int, help="token ids below this [server's]")
    workload.add_argument("--max-model-len", type=int, help="chat: clip to this [server's]")
    workload.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    workload.add_argument(
        "--inject-long-at", type=float, action="append", metavar="S",
        help="send a long prompt S seconds after the start (repeatable)",
    )  # fmt: skip
    workload.add_argument("--long-input-len", type=int, default=2048, help="long prompt tokens")
    workload.add_argument("--long-output-len", type=int, default=16, help="long prompt output")
    workload.add_argument("--long-fraction", type=float, default=0.1, help="mixed: documents")
    load = parser.add_argument_group("load and results")
    levels = load.add_mutually_exclusive_group(required=True)
    # A sweep takes comma-separated levels ("1,2,4"), a run one number.
    levels.add_argument("--concurrency", type=str if sweep else int, help="requests in flight")
    levels.add_argument("--rate", type=str if sweep else float, help="open loop: arrivals per s")
    load.add_argument("--num-requests", type=int, help="requests per run [100]")
    load.add_argument("--duration", type=float, help="stop sending after S s")
    load.add_argument("--timeout", type=float, default=3600.0, help="bound on a whole run, s")
    load.add_argument("--warmup", type=int, default=1, help="unrecorded requests first")
    load.add_argument("--ttft-slo", type=float, help="TTFT target, s")
    load.add_argument("--itl-slo", type=float, help="ITL (TPOT) target, s")
    load.add_argument("--long-ttft-slo", type=float, help="TTFT target of long documents, s")
    load.add_argument("--out", help="write the results JSON here")
    load.add_argument("--markdown", action="store_true", help="tables as markdown")
    load.add_argument("--no-progress", action="store_true", help="no progress bar")
    if sweep:
        load.add_argument("--plot", help="PNG: frontier (concurrency) or goodput (rate)")
        load.add_argument("--label", help="series name in the plot (default target)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem-bench", description=__doc__.split("\n")[0])
    suites = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, (_, summary) in SUITES.items():
        suite = suites.add_parser(name, help=summary, description=summary)
        for flags, keywords in OPTIONS.get(name, []):
            suite.add_argument(*flags, **keywords)
        suite.set_defaults(**DEFAULTS.get(name, {}))
        if name in ("run", "sweep"):
            _load_options(suite, sweep=name == "sweep")
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if getattr(args, "quick", False):
        for name, value in QUICK.get(args.suite, {}).items():
            setattr(args, name, value)
    if args.suite == "slo" and args.model is None:
        args.model = Path(f"models/tandem-{args.preset}")
    args.command = " ".join(["tandem-bench", *argv])
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if argv[0] not in SUITES:
        known = ", ".join(SUITES)
        print(f"tandem-bench: unknown suite {argv[0]!r}; one of {known}", file=sys.stderr)
        return 2
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from tandem.bench.harness import exit_on_sigterm

    exit_on_sigterm()  # SIGTERM unwinds `harness.running`, which stops the servers
    module = importlib.import_module(f"tandem.bench.{SUITES[args.suite][0]}")
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
