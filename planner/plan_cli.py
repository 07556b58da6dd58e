"""`tandem plan`: simulate every split of a worker budget and recommend one.

    tandem plan --profile P --workers N --ttft-slo S --tpot-slo S
                (--isl A --osl B [--isl-std X --osl-std Y] | --trace FILE)
                [--prefix-share F] [--num-requests K] [--shared-cores C]
                [--json] [--plot out.png]

Bad input (a missing or foreign profile, a malformed trace line, an SLO <= 0, a
budget below 2) gets one line naming the file, line or flag and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tandem.planner.profile_format import ProfileError, load_profile
from tandem.planner.profile_model import LatencyLaws
from tandem.planner.search import LayoutResult, Plan, plan
from tandem.planner.simulator import SimSettings, SloTargets
from tandem.planner.traces import TraceError, read_trace
from tandem.planner.workload import PlanWorkload, synthetic_workload, trace_workload

EXIT_USAGE = 2


def add_plan_command(commands: argparse._SubParsersAction) -> None:
    cmd = commands.add_parser(
        "plan", help="simulate every prefill:decode split of N workers and recommend one"
    )
    cmd.add_argument("--profile", required=True, help="profile.json from `tandem profile`")
    cmd.add_argument("--workers", type=int, required=True, help="worker budget N (>= 2)")
    cmd.add_argument("--ttft-slo", type=float, required=True, help="time-to-first-token SLO, s")
    cmd.add_argument("--tpot-slo", type=float, required=True, help="time-per-output-token SLO, s")
    cmd.add_argument("--isl", type=float, default=None, help="mean prompt tokens")
    cmd.add_argument("--osl", type=float, default=None, help="mean output tokens")
    cmd.add_argument("--isl-std", type=float, default=0.0, help="prompt length std [0]")
    cmd.add_argument("--osl-std", type=float, default=0.0, help="output length std [0]")
    cmd.add_argument("--trace", default=None, help="a JSONL or Azure CSV trace instead")
    cmd.add_argument(
        "--prefix-share", type=float, default=0.0,
        help="share of each synthetic prompt that is a shared, cacheable prefix [0]",
    )  # fmt: skip
    cmd.add_argument(
        "--num-requests", type=int, default=300,
        help="synthetic requests per simulated run (more at high rates) [300]",
    )  # fmt: skip
    cmd.add_argument(
        "--max-local-prefill-tokens", type=int, default=512,
        help="the router's bound on decode-side prefills [512]",
    )  # fmt: skip
    cmd.add_argument(
        "--shared-cores", type=float, default=None,
        help="all workers on one CPU node of C cores, each with the profile's threads "
        "(`tandem serve` on one machine); steps slow down while workers share them [not shared]",
    )  # fmt: skip
    cmd.add_argument("--seed", type=int, default=0, help="synthetic workload seed [0]")
    cmd.add_argument("--json", action="store_true", help="print the plan as JSON")
    cmd.add_argument("--plot", default=None, help="write goodput per split to this PNG")
    cmd.set_defaults(handler=run_plan, plan_parser=cmd)


class UsageError(ValueError):
    """Input `tandem plan` cannot use; the message names the flag, file or line."""


def _checked(args: argparse.Namespace) -> tuple[LatencyLaws, SimSettings, SloTargets, PlanWorkload]:
    if args.workers < 2:
        raise UsageError(f"--workers must be >= 2 (one prefill + one decode), got {args.workers}")
    for flag, value in (("--ttft-slo", args.ttft_slo), ("--tpot-slo", args.tpot_slo)):
        if not value > 0:
            raise UsageError(f"{flag} must be > 0 seconds, got {value:g}")
    if (args.trace is None) == (args.isl is None and args.osl is None):
        raise UsageError("give either --isl and --osl, or --trace FILE")
    if args.trace is None and (args.isl is None or args.osl is None):
        raise UsageError("--isl and --osl go together")
    for flag, value in (
        ("--isl", args.isl),
        ("--osl", args.osl),
        ("--num-requests", args.num_requests),
    ):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value:g}")
    if args.max_local_prefill_tokens < 0:
        raise UsageError("--max-local-prefill-tokens must be >= 0")
    for flag, value in (("--isl-std", args.isl_std), ("--osl-std", args.osl_std)):
        if value < 0:
            raise UsageError(f"{flag} must be >= 0, got {value:g}")
    if args.shared_cores is not None and not args.shared_cores > 0:
        raise UsageError(f"--shared-cores must be > 0, got {args.shared_cores:g}")
    if not 0 <= args.prefix_share < 1:
        raise UsageError(f"--prefix-share must be in [0, 1), got {args.prefix_share:g}")
    profile = load_profile(args.profile)
    laws = LatencyLaws.fit(profile)
    limits = profile.engine
    if args.trace is not None:
        workload = trace_workload(read_trace(args.trace), limits.max_model_len)
    else:
        workload = synthetic_workload(
            args.isl, args.osl, isl_std=args.isl_std, osl_std=args.osl_std,
            num_requests=args.num_requests, max_model_len=limits.max_model_len,
            prefix_share=args.prefix_share, seed=args.seed,
        )  # fmt: skip
    settings = SimSettings(
        limits, max_local_prefill_tokens=args.max_local_prefill_tokens, seed=args.seed,
        shared_cores=args.shared_cores,
        threads_per_worker=_threads(profile.hardware.get("num_threads")),
    )  # fmt: skip
    return laws, settings, SloTargets(args.ttft_slo, args.tpot_slo), workload


def _threads(value: object) -> int:
    """The profile's torch threads per worker (1 when it does not say)."""
    return value if isinstance(value, int) and value >= 1 else 1


def run_plan(args: argparse.Namespace) -> int:
    try:
        laws, settings, slo, workload = _checked(args)
    except (UsageError, ProfileError, TraceError) as exc:
        print(f"tandem plan: {exc}", file=sys.stderr)
        return EXIT_USAGE
    result = plan(laws, settings, args.workers, slo, workload)
    if args.plot:
        from tandem.planner.plot import plot_plan

        plot_plan(result, args.plot, title=f"{args.workers} workers, {workload.name}")
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(format_plan(result))
        if args.plot:
            print(f"plot: {Path(args.plot)}")
    return 0


def format_plan(result: Plan) -> str:
    rows = [f"{'layout':<14}{'goodput req/s':>14}{'TTFT p90 s':>12}{'TPOT p90 s':>12}"
            f"{'attained':>10}"]  # fmt: skip
    for r in [*result.splits, result.colocated]:
        mark = "  <- recommended" if r is result.recommended else ""
        rows.append(_row(r) + mark)
    best = result.recommended.layout
    rows.append(f"recommended: {best.num_prefill} prefill + {best.num_decode} decode")
    rows.append(f"reason: {result.reason}")
    return "\n".join(rows)


def _row(r: LayoutResult) -> str:
    return (f"{r.layout.label:<14}{r.goodput_rps:>14.3f}{r.ttft_p90_s:>12.4f}"
            f"{r.tpot_p90_s:>12.4f}{r.report.attainment:>10.1%}")  # fmt: skip
