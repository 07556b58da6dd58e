"""`tandem profile --model DIR [--device cpu|cuda] [--threads N] [--quick] --out profile.json`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

EXIT_USAGE = 2


def add_profile_command(commands: argparse._SubParsersAction) -> None:
    cmd = commands.add_parser(
        "profile", help="measure prefill, decode and KV transfer times on this machine"
    )
    cmd.add_argument("--model", required=True, help="Hugging Face model directory")
    cmd.add_argument("--device", choices=["cpu", "cuda"], default=None,
                     help="[cuda if present, else cpu]")  # fmt: skip
    cmd.add_argument("--threads", type=int, default=None,
                     help="torch threads [every core, as tandem serve's workers get]")  # fmt: skip
    cmd.add_argument("--quick", action="store_true", help="fewer, smaller points (minutes)")
    cmd.add_argument("--out", required=True, help="where to write profile.json")
    cmd.set_defaults(handler=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    import torch

    if args.threads is not None and args.threads < 1:
        print(f"tandem profile: --threads must be >= 1, got {args.threads}", file=sys.stderr)
        return EXIT_USAGE
    if args.device == "cuda" and not torch.cuda.is_available():
        print("tandem profile: --device cuda: this machine has no CUDA device", file=sys.stderr)
        return EXIT_USAGE
    if not (Path(args.model) / "config.json").is_file():
        print(f"tandem profile: --model {args.model}: no config.json there", file=sys.stderr)
        return EXIT_USAGE
    from tandem.engine.host_cpus import available_cpus
    from tandem.planner.profile import measure_profile
    from tandem.planner.profile_format import save_profile

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    try:
        # `tandem serve`'s default thread policy (shared) gives each worker every CPU it
        # may use; torch's own default can be fewer (physical cores, not logical CPUs).
        threads = args.threads or available_cpus()
        profile = measure_profile(args.model, device, threads, args.quick)
    except ValueError as exc:
        print(f"tandem profile: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = save_profile(profile, args.out)
    print(f"profile of {args.model} on {device} written to {out} "
          f"in {time.perf_counter() - started:.0f} s")  # fmt: skip
    return 0
