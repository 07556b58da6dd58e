"""`tandem-bench planner-fidelity`: the planner's simulator against measured runs.

For each layout (1P+1D, 2 colocated, 2P+1D) and bench workload (chat, documents,
mixed): the planner's goodput (`tandem plan`'s search on a profile of this machine)
and a measured sweep of `tandem serve` with that layout (`fidelity_sweep`: capped
open-loop runs of fresh requests, starting at the planner's goodput and bracketing
the measured one), with the simulator replaying each swept run. The profile is taken
with the torch threads `tandem serve` gives each worker (`--thread-policy shared`: all
cores), and the servers run with exactly those threads; the simulator lets the
workers share the node's cores (`planner.sim_cores`). One server per layout serves
its three workloads (every run's prompts are fresh). The table (`fidelity_table`)
lands in docs/benchmarks.md (`## Planner fidelity`); the raw points in `--json`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tandem.bench.harness import ensure_model, free_port, running, tandem_spec
from tandem.bench.loadgen.clients import ClientConfig, ServerInfo, make_client
from tandem.bench.loadgen.load import LoadConfig, run_load
from tandem.bench.loadgen.metrics import SloTargets
from tandem.bench.loadgen.runner import WorkloadConfig, build_workload
from tandem.bench.loadgen.tables import crossing_rate
from tandem.bench.loadgen.workloads import FixedWorkload, Vocab, take
from tandem.bench.planner.fidelity_sweep import TARGET_ATTAINMENT, Cell, RatePoint, SweepSettings
from tandem.bench.planner.fidelity_table import METRICS, Pair, Row, render, summary_line
from tandem.bench.report import machine_facts, machine_sentence, publish, run_block, write_json
from tandem.engine.host_cpus import available_cpus
from tandem.planner.profile import ProfileGrid, measure_profile
from tandem.planner.profile_format import Profile, load_profile, save_profile
from tandem.planner.profile_model import LatencyLaws
from tandem.planner.search import max_goodput
from tandem.planner.simulator import ClusterSimulation, Layout, SimReport, SimSettings
from tandem.planner.simulator import SloTargets as SimSlo
from tandem.planner.workload import PlanRequest, PlanWorkload

logger = logging.getLogger(__name__)

HEADING = "## Planner fidelity"
COMMAND = "tandem-bench planner-fidelity --model models/tandem-small"
LAYOUTS = {
    "1P+1D": (Layout(1, 1), ("--prefill", "1", "--decode", "1")),
    "2 colocated": (Layout(num_colocated=2), ("--colocated", "2")),
    "2P+1D": (Layout(2, 1), ("--prefill", "2", "--decode", "1")),
}
# Documents are 512-token prompts: 1024-token ones sustain about 0.1 req/s within a 3 s
# TTFT on 2 cores, and a sweep at that rate would not fit the time; the mixed workload
# keeps long documents (1536 tokens: three prefill chunks).
WORKLOADS = {
    "chat": WorkloadConfig(kind="chat", input_len=192, output_len=64),
    "documents": WorkloadConfig(kind="fixed", input_len=512, output_len=16),
    "mixed": WorkloadConfig(kind="mixed", input_len=192, output_len=64, long_fraction=0.1,
                            long_input_len=1536, long_output_len=16),
}  # fmt: skip
SLO = (3.0, 0.25)  # TTFT s, TPOT s
MAX_MODEL_LEN = 2048
# What the simulation needs: prompts up to two budget-sized chunks (the cached share
# gives a chunk after earlier ones), decode batches as large as the runs reach.
PROFILE_GRID = ProfileGrid((32, 128, 256, 512, 1024), (0.5,), (1, 4, 16, 32), (64, 512),
                           (256, 2048), 3)  # fmt: skip
# A smoke run: short runs, and rates from 0.2 req/s (a loaded machine's profile can make
# the planner's goodput 0, and 4 requests at 0.05 req/s would take over a minute).
QUICK_SWEEP = SweepSettings(duration_s=4.0, grace_s=4.0, min_requests=4, max_runs=2,
                            min_rate_rps=0.2)  # fmt: skip


def plan_workload(config: WorkloadConfig, server: ServerInfo, seed: int) -> PlanWorkload:
    """The bench workload's own requests (same lengths) as the planner's, Poisson."""
    specs = take(build_workload(replace(config, seed=seed), server), 200)
    requests = tuple(PlanRequest(s.prompt_len, s.max_tokens) for s in specs)
    rng, t, arrivals = random.Random(seed), 0.0, []
    for _ in requests:
        arrivals.append(t)
        t += rng.expovariate(1.0)
    return PlanWorkload(config.kind, requests, tuple(arrivals))


def _profile(args: argparse.Namespace, model: Path) -> tuple[Profile, str]:
    if args.profile is not None:
        return load_profile(args.profile), f"Profile: `{args.profile}` (`tandem profile`)."
    # `--thread-policy shared` (serve's default) gives every worker all the cores.
    threads = available_cpus()
    grid = ProfileGrid.make(True) if args.quick else PROFILE_GRID
    started = time.perf_counter()
    profile = measure_profile(str(model), "cpu", threads, quick=args.quick, grid=grid)
    saved = save_profile(profile, args.json.with_name("planner_fidelity_profile.json"))
    note = (
        f"Profile: measured at the start ({time.perf_counter() - started:.0f} s, {threads} "
        f"torch threads, prompts {grid.prompt_tokens}, decode batches {grid.batch_sizes} x "
        f"contexts {grid.context_tokens}), saved to `{saved}`."
    )
    return profile, note


def _p(report: SimReport, values: list[float], q: float) -> float:
    return report.percentile(values, q)


def _sim_latencies(report: SimReport) -> dict[str, float]:
    return dict(zip(METRICS, (_p(report, report.ttft_s, 0.5), _p(report, report.ttft_s, 0.9),
                              _p(report, report.tpot_s, 0.5), _p(report, report.tpot_s, 0.9)),
                    strict=True))  # fmt: skip


def _local_share(counts: list[dict[str, float]]) -> float:
    total = sum(sum(c.values()) for c in counts)
    return sum(c.get("local_prefill", 0.0) for c in counts) / total if total else math.nan


def _goodput(points: list[tuple[float, float]]) -> float:
    return crossing_rate(points, TARGET_ATTAINMENT)


def make_row(layout: str, workload: str, planner_rps: float, points: list[RatePoint],
             num_cores: int) -> Row:  # fmt: skip
    met = [p for p in points if p.met]
    at = max(met, key=lambda p: p.rate_rps) if met else min(points, key=lambda p: p.rate_rps)
    m = at.measured
    measured = dict(zip(METRICS, (m.ttft_s.p50, m.ttft_s.p90, m.tpot_s.p50, m.tpot_s.p90),
                        strict=True))  # fmt: skip
    sim = _sim_latencies(at.sim)
    colocated = "colocated" in layout
    bound = "" if met and len(met) < len(points) else (">" if met else "<")
    measured_rps = _goodput([(p.rate_rps, p.measured.slo_attainment) for p in points])
    if bound == "<":  # below the lowest swept rate: that rate is the bound
        measured_rps = min(p.rate_rps for p in points)
    return Row(
        layout, workload,
        Pair(planner_rps, measured_rps),
        _goodput([(p.rate_rps, p.sim.attainment) for p in points]),
        _goodput([(p.rate_rps, p.sim_unshared.attainment) for p in points]),
        at.rate_rps,
        {k: Pair(sim[k], measured[k]) for k in METRICS},
        _sim_latencies(at.sim_unshared),
        m.num_succeeded,
        Pair(math.nan, math.nan) if colocated else Pair(
            _local_share([dict(p.sim.decisions) for p in points]),
            _local_share([p.decisions for p in points])),
        sum(p.num_cut for p in points),
        os.getloadavg()[0],
        num_cores,
        [{"rate_rps": p.rate_rps, "seed": p.seed, "sent": p.num_sent,
          "attainment": p.measured.slo_attainment, "sim_attainment": p.sim.attainment,
          "sim_unshared_attainment": p.sim_unshared.attainment, "cut": p.num_cut,
          "sim_cut": p.sim.num_cut, "decisions": p.decisions,
          "sim_decisions": dict(p.sim.decisions), "router_cores": p.router_cores,
          "client_cores": p.client_cores} for p in points],
        bound,
        at.router_cores + at.client_cores,
    )  # fmt: skip


@dataclass(frozen=True)
class Budget:
    """When the whole run should end (refining runs are skipped to meet it)."""

    deadline_s: float  # time.perf_counter() value


async def _layout_rows(name: str, layout: Layout, target: str, http_url: str, laws: LatencyLaws,
                       settings: dict[bool, SimSettings], sweep: SweepSettings,
                       num_cores: int, budget: Budget, layouts_left: int,
                       router_pid: int) -> list[Row]:  # fmt: skip
    client = make_client(ClientConfig(target=target))
    rows = []
    try:
        server = await client.start()
        warmup = FixedWorkload(Vocab(server.vocab_size or 32000, 99), 16, 4, tag="warmup")
        await run_load(client, warmup, LoadConfig(concurrency=1, num_requests=2, progress=False))
        slo = SimSlo(*SLO)
        for index, (wname, wconfig) in enumerate(WORKLOADS.items()):
            started = time.perf_counter()
            seed_base = 100 * (index + 1)
            predicted = max_goodput(laws, settings[True], layout, slo,
                                    plan_workload(wconfig, server, seed_base))  # fmt: skip
            logger.info("%s %s: planner goodput %.3g req/s (searched in %.0f s)", name, wname,
                        predicted.goodput_rps, time.perf_counter() - started)  # fmt: skip

            def simulation(shared: bool, layout: Layout = layout) -> ClusterSimulation:
                return ClusterSimulation(laws, settings[shared], layout, slo)

            cell = Cell(client, server, f"{http_url}/metrics", wconfig, SloTargets(*SLO),
                        simulation, sweep, seed_base, router_pid)  # fmt: skip
            cells_left = len(WORKLOADS) * layouts_left - index
            allowance_s = (budget.deadline_s - time.perf_counter()) / cells_left
            points = await cell.sweep(max(predicted.goodput_rps, sweep.min_rate_rps), allowance_s)
            rows.append(make_row(name, wname, predicted.goodput_rps, points, num_cores))
            logger.info("%s %s: %.0f s, %s", name, wname, time.perf_counter() - started, rows[-1])
    finally:
        await client.close()
    return rows


def main(args: argparse.Namespace) -> int:
    started, facts = time.perf_counter(), machine_facts()
    model = ensure_model(args.model, "tiny" if "tiny" in str(args.model) else "small")
    profile, profile_note = _profile(args, model)
    laws = LatencyLaws.fit(profile)
    threads = int(profile.hardware.get("num_threads") or 1)
    num_cores = int(profile.hardware.get("num_cores") or available_cpus())
    settings = {
        True: SimSettings(profile.engine, shared_cores=num_cores, threads_per_worker=threads),
        False: SimSettings(profile.engine),
    }
    sweep = QUICK_SWEEP if args.quick else SweepSettings(args.duration, args.grace)
    if args.num_requests is not None:
        sweep = replace(sweep, max_requests=args.num_requests)
    rows: list[Row] = []
    logs = args.json.parent / "planner-fidelity-logs"
    budget = Budget(started + 60 * args.budget_min)
    for number, (name, (layout, flags)) in enumerate(LAYOUTS.items()):
        grpc_port, http_port = free_port(), free_port()
        flags = (*flags, "--device", "cpu", "--kv-backend", "tcp", "--threads", str(threads),
                 "--max-model-len", str(MAX_MODEL_LEN), "--planner", "off",
                 "--ttft-slo", str(SLO[0]), "--itl-slo", str(SLO[1]))  # fmt: skip
        spec = tandem_spec("tandem", str(model), grpc_port, http_port, flags)
        assert spec.grpc_target is not None
        # Server logs stay there for a look after a failed start.
        with running([spec], logs / name.replace(" ", "-")) as (server,):
            rows += asyncio.run(_layout_rows(name, layout, spec.grpc_target, spec.http_url, laws,
                                             settings, sweep, num_cores, budget,
                                             len(LAYOUTS) - number, server.pid))  # fmt: skip
    write_json(args.json, {"facts": facts, "profile_hardware": profile.hardware,
                           "sweep": sweep, "rows": rows})  # fmt: skip
    wall_s = time.perf_counter() - started
    publish(None if args.quick else args.out, HEADING, _blocks(args, rows, profile_note, sweep,
                                                               threads, wall_s, facts))  # fmt: skip
    return 0


def _blocks(args: argparse.Namespace, rows: list[Row], profile_note: str, sweep: SweepSettings,
            threads: int, wall_s: float, facts: dict[str, Any]) -> list[str]:  # fmt: skip
    machine = machine_sentence(facts, list(os.getloadavg()))
    method = (
        f"{profile_note} Servers: `tandem serve` on the CPU, KV over TCP, `--threads "
        f"{threads}` per worker (what `--thread-policy shared` gives); the simulator lets "
        f"busy workers share the {facts['cores']} cores. SLO: TTFT <= {SLO[0]:g} s, TPOT <= "
        f"{SLO[1]:g} s. Each swept rate: fresh requests, Poisson arrivals for about "
        f"{sweep.duration_s:g} s (at least {sweep.min_requests} requests), requests still in "
        f"flight {sweep.grace_s:g} s after the last arrival cut and counted outside the SLO "
        "(the simulator cuts its replay there too); rates start at the "
        f"planner's goodput and bracket the measured one (at most {sweep.max_runs} per cell). "
        "Goodput: where attainment crosses 90%. Latencies: at the highest swept rate that met "
        "it, the simulator replaying the same requests. Error = (simulated - measured) / "
        "measured; targets: goodput within 15%, percentiles within 25%."
    )
    return [run_block(COMMAND, args.command, wall_s, machine), method,
            summary_line(rows), render(rows)]  # fmt: skip
