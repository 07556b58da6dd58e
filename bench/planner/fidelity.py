"""`tandem-bench planner-fidelity`: the planner's simulator against measured runs.

For each layout (1P+1D, 2 colocated, 2P+1D) and bench workload (chat, documents,
mixed): profile this machine (`tandem profile`), simulate the layout's goodput (the
highest rate with >= 90% of requests within SLO) and its latency percentiles, then run
`tandem serve` with that layout and sweep open-loop Poisson rates around the predicted
goodput with the bench load generator. Measured goodput is where attainment crosses
90% (interpolated); TTFT / TPOT p50 and p90 are compared at the first swept rate.
Every error is (simulated - measured) / measured. The section lands in
docs/benchmarks.md (`## Planner fidelity`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.bench.experiments.goodput import sustained_rate
from tandem.bench.harness import ensure_model, free_port, running, tandem_spec
from tandem.bench.loadgen.clients import ClientConfig, ServerInfo
from tandem.bench.loadgen.load import LoadConfig
from tandem.bench.loadgen.metrics import SloTargets
from tandem.bench.loadgen.runner import BenchConfig, WorkloadConfig, build_workload, run_sweep
from tandem.bench.loadgen.runner import sweep_points as to_points
from tandem.bench.loadgen.workloads import take
from tandem.bench.report import machine_facts, machine_sentence, publish, render_table, run_block
from tandem.planner.profile import measure_profile
from tandem.planner.profile_format import load_profile
from tandem.planner.profile_model import LatencyLaws
from tandem.planner.search import max_goodput
from tandem.planner.simulator import ClusterSimulation, Layout, SimSettings
from tandem.planner.simulator import SloTargets as SimSlo
from tandem.planner.workload import PlanRequest, PlanWorkload

logger = logging.getLogger(__name__)

HEADING = "## Planner fidelity"
LAYOUTS = {
    "1P+1D": (Layout(1, 1), ("--prefill", "1", "--decode", "1")),
    "2 colocated": (Layout(num_colocated=2), ("--colocated", "2")),
    "2P+1D": (Layout(2, 1), ("--prefill", "2", "--decode", "1")),
}
WORKLOADS = {
    "chat": WorkloadConfig(kind="chat", input_len=192, output_len=64),
    "documents": WorkloadConfig(kind="fixed", input_len=1024, output_len=16),
    "mixed": WorkloadConfig(kind="mixed", input_len=192, output_len=64, long_fraction=0.1,
                            long_input_len=1536, long_output_len=16),
}  # fmt: skip
SLO = (3.0, 0.25)  # TTFT s, TPOT s
MAX_MODEL_LEN = 2048
RATE_FACTORS = (0.6, 0.9, 1.1, 1.4)


@dataclass(frozen=True)
class Row:
    layout: str
    workload: str
    # (simulated, measured) pairs
    goodput_rps: tuple[float, float]
    ttft_p50_s: tuple[float, float]
    ttft_p90_s: tuple[float, float]
    tpot_p50_s: tuple[float, float]
    tpot_p90_s: tuple[float, float]


def plan_workload(config: WorkloadConfig, vocab_size: int) -> tuple[PlanWorkload, int]:
    """The bench workload's own requests (same seed, same lengths) as the planner's."""
    server = ServerInfo("model", MAX_MODEL_LEN, vocab_size, "ids")
    specs = take(build_workload(config, server), 200)
    requests = tuple(PlanRequest(s.prompt_len, s.max_tokens) for s in specs)
    # Arrival pattern: Poisson at rate 1 (the load generator's open loop is Poisson).
    rng, t, arrivals = random.Random(0), 0.0, []
    for _ in requests:
        arrivals.append(t)
        t += rng.expovariate(1.0)
    return PlanWorkload(config.kind, requests, tuple(arrivals)), len(specs)


def simulate(laws: LatencyLaws, settings: SimSettings, layout: Layout, workload: PlanWorkload,
             rate: float) -> tuple[float, float, float, float]:  # fmt: skip
    report = ClusterSimulation(laws, settings, layout, SimSlo(*SLO)).run(workload, rate)
    pick = report.percentile
    return (pick(report.ttft_s, 0.5), pick(report.ttft_s, 0.9),
            pick(report.tpot_s, 0.5), pick(report.tpot_s, 0.9))  # fmt: skip


def measure(model: Path, flags: tuple[str, ...], config: WorkloadConfig, rates: list[float],
            num_requests: int, log_dir: Path) -> list:  # fmt: skip
    grpc_port, http_port = free_port(), free_port()
    flags = (*flags, "--device", "cpu", "--kv-backend", "tcp", "--max-model-len",
             str(MAX_MODEL_LEN), "--planner", "off", "--ttft-slo", str(SLO[0]),
             "--itl-slo", str(SLO[1]))  # fmt: skip
    spec = tandem_spec("tandem", str(model), grpc_port, http_port, flags)
    bench = BenchConfig(
        client=ClientConfig(target=f"grpc://127.0.0.1:{grpc_port}"),
        workload=config,
        load=LoadConfig(rate_rps=rates[0], num_requests=num_requests),
        slo=SloTargets(*SLO),
        warmup_requests=2,
    )
    loads = [LoadConfig(rate_rps=r, num_requests=num_requests, timeout_s=900) for r in rates]
    with running([spec], log_dir):
        return asyncio.run(run_sweep(bench, loads))


def _err(sim: float, measured: float) -> str:
    if not (math.isfinite(sim) and math.isfinite(measured)) or measured <= 0:
        return "-"
    return f"{(sim - measured) / measured:+.0%}"


def render(rows: list[Row]) -> str:
    header = ["layout", "workload", "goodput sim / meas (err)", "TTFT p50", "TTFT p90",
              "TPOT p50", "TPOT p90"]  # fmt: skip

    def cell(pair: tuple[float, float], unit: str = "s") -> str:
        sim, measured = pair
        return f"{sim:.3g} / {measured:.3g} {unit} ({_err(sim, measured)})"

    body = [[r.layout, r.workload, cell(r.goodput_rps, "req/s"), cell(r.ttft_p50_s),
             cell(r.ttft_p90_s), cell(r.tpot_p50_s), cell(r.tpot_p90_s)] for r in rows]  # fmt: skip
    return render_table(header, body)


def main(args: argparse.Namespace) -> int:
    started, facts = time.perf_counter(), machine_facts()
    model = ensure_model(args.model, "tiny" if "tiny" in str(args.model) else "small")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    if args.profile is not None:
        # A profile `tandem profile` wrote on this machine (e.g. a `--quick` one, when the
        # full grid would not fit the time there is).
        profile = load_profile(args.profile)
        profile_note = f"Profile: `{args.profile}` (`tandem profile`), read at the start."
    else:
        threads = max(1, (os.cpu_count() or 2) // 2)
        profile = measure_profile(str(model), "cpu", threads, quick=args.quick)
        profile_note = "Profile: measured at the start of this run."
    laws = LatencyLaws.fit(profile)
    settings = SimSettings(profile.engine)
    layouts = dict(list(LAYOUTS.items())[:1]) if args.quick else LAYOUTS
    workloads = dict(list(WORKLOADS.items())[:1]) if args.quick else WORKLOADS
    num_requests = 12 if args.quick else args.num_requests
    factors = RATE_FACTORS[:1] if args.quick else RATE_FACTORS
    rows = []
    logs = args.json.parent / "planner-fidelity-logs"
    # Server logs stay there for a look after a failed start.
    for name, (layout, flags) in layouts.items():
        for wname, wconfig in workloads.items():
            workload, _ = plan_workload(wconfig, vocab)
            predicted = max_goodput(laws, settings, layout, SimSlo(*SLO), workload)
            base = max(predicted.goodput_rps, 0.05)
            rates = [round(base * f, 3) for f in factors]
            results = measure(
                model, flags, wconfig, rates, num_requests, logs / name.replace(" ", "-")
            )
            points = to_points(results)
            first = results[0].summary
            sim = simulate(laws, settings, layout, workload, rates[0])
            measured = (first.ttft_s.p50, first.ttft_s.p90, first.tpot_s.p50,
                        first.tpot_s.p90)  # fmt: skip
            rows.append(Row(name, wname, (predicted.goodput_rps, sustained_rate(points)),
                            *zip(sim, measured, strict=True)))  # fmt: skip
            logger.info("%s %s: %s", name, wname, rows[-1])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1) + "\n")
    command = "tandem-bench planner-fidelity --model models/tandem-small"
    wall_s = time.perf_counter() - started
    machine = machine_sentence(facts, list(os.getloadavg()))
    blocks = [
        run_block(command, args.command, wall_s, machine),
        f"{profile_note} "
        f"SLO: TTFT <= {SLO[0]:g} s, TPOT <= {SLO[1]:g} s. Goodput: highest rate with >= 90% "
        f"within SLO; latencies at {factors[0]:g}x the predicted goodput. Error = "
        "(simulated - measured) / measured; targets: goodput within 15%, percentiles within 25%.",
        render(rows),
    ]
    publish(None if args.quick else args.out, HEADING, blocks)
    return 0
