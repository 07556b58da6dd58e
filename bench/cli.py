"""`tandem-bench`: one command line for every benchmark suite (the product never imports it).

    tandem-bench engine [--quick] [--out docs/benchmarks.md]      # engine vs floor, roofline, HF
    tandem-bench engine --penalties [--quick]                     # cost of sampling penalties
    tandem-bench engine --step-profile [--quick] [--dtype D]      # a decode step's time by part
    tandem-bench engine --attention [--quick]                     # CPU decode attention backends
    tandem-bench kv-transfer [--model DIR]                        # KV transfer vs raw TCP
    tandem-bench topology [--quick] [--variants split ...]        # make serve vs transformers
    tandem-bench gpu-check [--dry-run]                            # one prepared GPU run
    tandem-bench router [--quick]                                 # router overhead
    tandem-bench slo [--quick]                                    # SLO admission under overload
    tandem-bench structured [--quick]                             # JSON-schema cost per token
    tandem-bench experiment all|head-of-line|frontier|goodput    # the published experiments
    tandem-bench planner-fidelity [--quick]                       # simulator vs measured runs
    tandem-bench pools [--kills N] [--drains N]                   # heal, migration, drain times

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
    "topology": ("experiments.topology", "make serve's topology vs transformers serve, c=1/8"),
    "gpu-check": ("gpu_check", "one prepared GPU run: equality, decode roofline, MFU, KV GB/s"),
    "router": ("router.overhead", "router overhead: added latency and one core's throughput"),
    "slo": ("router.slo", "SLO admission under overload: shed vs admit everything"),
    "structured": ("engine.structured", "TPOT with and without a JSON schema, batch 1 and 8"),
    "experiment": ("experiments.cli", "a published experiment: servers, load, plots, section"),
    "planner-fidelity": ("planner.fidelity", "the planner's simulator against measured runs"),
    "pools": ("pools.bench", "elastic pools under load: heal after kill -9, migration, drain"),
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
    "engine": [
        _model("models/tandem-small"), (("--out",), {**_OUT[1], "default": None}), _QUICK,
        (("--dtype",), {"choices": ["auto", "float32", "bfloat16", "float16"], "default": None,
                        "help": "only this dtype (auto: what `tandem serve` picks here) "
                        "[float32 and bfloat16; --quick: float32]"}),
        (("--penalties",), {"action": "store_true",
                            "help": "only the cost of penalties + logit_bias (TPOT, batch 1/8)"}),
        (("--step-profile",), {"action": "store_true",
                               "help": "only where a decode step's time goes (CPU time by "
                               "part, top ops) next to its matmul floor; prints, writes no doc"}),
        (("--attention",), {"action": "store_true",
                            "help": "only CPU decode attention per layer: cpu vs torch backend"}),
    ],
    "kv-transfer": [
        _model("models/tandem-small"), _OUT,
        (("--repeats",), {"type": int, "default": 15,
                          "help": "rounds of every variant (x 8192/tokens below 8k)"}),
        (("--prefill-tokens-per-s",), {"type": float, "help": "else measured"}),
    ],
    "topology": [
        _model("models/tandem-small"), _OUT, _QUICK,
        (("--variants",), {"nargs": "*", "default": [], "choices": ["split", "one-thread",
                           "colocated-1", "colocated-2", "all-remote", "spin-wait",
                           "passive-wait", "decode-2", "decode-2-spin-wait"],
                           "help": "more `tandem serve` layouts measured alike"}),
        (("--no-peer",), {"action": "store_true", "help": "Tandem layouts only (A/B runs)"}),
        (("--plain-peer",), {"action": "store_true",
                             "help": "also transformers serve without continuous batching"}),
        (("--concurrency",), {"type": int, "nargs": "+", "default": [1, 8]}),
        (("--input-len",), {"type": int, "default": 128}),
        (("--output-len",), {"type": int, "default": 64}),
        (("--requests-per-slot",), {"type": int, "default": 4,
                                    "help": "requests per level: max(8, this x concurrency)"}),
        (("--rounds",), {"type": int, "default": 3, "help": "runs of every system"}),
        (("--results-dir",), {"type": Path, "default": Path("bench/results/topology")}),
    ],
    "gpu-check": [
        _OUT,
        (("--dry-run",), {"action": "store_true", "help": "CPU, tiny shapes: exercises the code"}),
        (("--workdir",), {"default": None, "help": "where the random checkpoints go [tmp]"}),
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
    "structured": [_model("models/tandem-small"), _OUT, _QUICK],
    "experiment": [
        (("name",), {"choices": ("head-of-line", "frontier", "goodput", "all")}),
        _model("models/tandem-small"), _QUICK,
        (("--doc",), {"default": DOC, "help": "report to update; '' = none"}),
        (("--img-dir",), {"type": Path, "default": Path("docs/img"), "help": "plots"}),
        (("--results-dir",), {"type": Path, "default": Path("bench/results/experiments")}),
    ],
    "planner-fidelity": [
        _model("models/tandem-small"), _OUT, _QUICK,
        (("--num-requests",), {"type": int, "default": None,
                                "help": "most requests per swept rate [no limit: --duration]"}),
        (("--duration",), {"type": float, "default": 25.0,
                           "help": "seconds of arrivals per swept rate"}),
        (("--grace",), {"type": float, "default": 20.0,
                        "help": "seconds after arrivals stop before in-flight requests are cut"}),
        (("--budget-min",), {"type": float, "default": 34.0,
                             "help": "minutes the whole run aims at (refining rates are "
                                     "skipped past it)"}),
        (("--profile",), {"type": Path, "default": None,
                          "help": "a `tandem profile` file of this machine [measure one]"}),
        (("--json",), {"type": Path, "default": Path("bench/results/planner_fidelity.json")}),
    ],
    "pools": [
        (("--preset",), {"default": "small", "choices": ["tiny", "small"]}),
        (_MODEL, {"type": Path, "help": "default: models/tandem-<preset>"}), _OUT,
        (("--json",), {"type": Path, "default": Path("bench/results/pools.json")}),
        (("--kills",), {"type": int, "default": 5, "help": "kill -9s of a decode worker"}),
        (("--drains",), {"type": int, "default": 3, "help": "scale-downs of decode by one"}),
        (("--concurrency",), {"type": int, "default": 6, "help": "streams in flight"}),
        (("--max-tokens",), {"type": int, "default": 128}),
        (("--prompts",), {"type": int, "default": 8, "help": "distinct prompts"}),
        (("--settle",), {"type": float, "default": 2.0, "help": "s of load before each event"}),
    ],
}  # fmt: skip
# Not options: fixed settings of the SLO suite's capacity probes (`--quick` shortens them).
DEFAULTS = {"slo": {"probe_duration": 10.0, "probe_requests": 30, "max_probes": 7,
                    "probe_step": 1.3}}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem-bench", description=__doc__.split("\n")[0])
    suites = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, (_, summary) in SUITES.items():
        suite = suites.add_parser(name, help=summary, description=summary)
        for flags, keywords in OPTIONS.get(name, []):
            suite.add_argument(*flags, **keywords)
        suite.set_defaults(**DEFAULTS.get(name, {}))
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if getattr(args, "quick", False):
        for name, value in QUICK.get(args.suite, {}).items():
            setattr(args, name, value)
    if args.suite in ("slo", "pools") and args.model is None:
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
