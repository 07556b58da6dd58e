"""`tandem-bench`: one command line for every benchmark suite (the product never imports it).

    tandem-bench engine [--quick] [--out docs/benchmarks.md]      # engine vs floor, roofline, HF
    tandem-bench kv-transfer [--model DIR]                        # KV transfer vs raw TCP
    tandem-bench router [--quick]                                 # router overhead
    tandem-bench slo [--quick]                                    # SLO admission under overload
    tandem-bench experiment all|head-of-line|frontier|goodput    # the published experiments
    tandem-bench run|sweep --target grpc://HOST:PORT|http://HOST:PORT [...]  # load generator

Each suite parses its own arguments (`tandem-bench SUITE --help`); only the chosen
suite's module is imported, so `tandem-bench --help` stays fast.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# suite -> module with `main(argv, prog) -> int`
SUITES = {
    "engine": "tandem.bench.engine.bench",
    "kv-transfer": "tandem.bench.kv_transfer.bench",
    "router": "tandem.bench.router.overhead",
    "slo": "tandem.bench.router.slo",
    "experiment": "tandem.bench.experiments.cli",
    "run": "tandem.bench.loadgen.cli",
    "sweep": "tandem.bench.loadgen.cli",
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if args[0] not in SUITES:
        print(
            f"tandem-bench: unknown suite {args[0]!r}; one of {', '.join(SUITES)}", file=sys.stderr
        )
        return 2
    suite, rest = args[0], args[1:]
    module = importlib.import_module(SUITES[suite])
    if suite in ("run", "sweep"):  # one parser, the action is its first argument
        return int(module.main([suite, *rest], prog="tandem-bench"))
    return int(module.main(rest, prog=f"tandem-bench {suite}") or 0)


if __name__ == "__main__":
    sys.exit(main())
