"""SLO admission under overload: shedding vs admitting everything, on a real cluster.

    PYTHONPATH=. .venv/bin/python -m bench.slo_bench [--out docs/benchmarks.md]

1. Calibrate on a fresh Ray `LocalCluster` (1 prefill + 1 decode worker, admission
   `none`): unloaded TTFT of a short-prompt request (sequential calls), the TTFT target
   (a multiple of it), then Poisson probes at rising rates; *capacity* = the highest
   rate whose requests still met the target ≥ 90% of the time.
2. Offer `--overload` × capacity as one open-loop Poisson trace (fixed seed) for a
   fixed duration, once on a fresh cluster with `admission_policy="shed"` and once
   with `"none"`, same trace, same warm-up (both with `max_local_prefill_tokens=0`);
   then once more with `shed` and the router's default conditional disaggregation.

Writes `## SLO admission under overload` of docs/benchmarks.md and raw numbers to
bench/results/slo.json. The client runs in this process; the router and the Ray
driver in a child process (`bench.router_cluster`); each worker is a Ray actor.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
import time
from pathlib import Path

import grpc

from tandem.bench.doc_sections import write_section
from tandem.bench.router_cluster import ClusterInfo, ensure_model, serve_cluster
from tandem.bench.router_load import distinct_prompts
from tandem.bench.router_procs import ServerProcess, exit_on_sigterm
from tandem.bench.router_report import (
    LatencySummary,
    format_ms,
    load_average,
    machine_facts,
    write_json,
)
from tandem.bench.slo_load import open_loop, scrape_counters, sequential
from tandem.bench.slo_metrics import (
    Probe,
    RunSummary,
    capacity_of,
    mean_itl_s,
    outcome_of,
    poisson_arrivals,
    summarize,
)
from tandem.bench.slo_report import (
    ITL_OFF_S,
    MIN_ATTAINMENT,
    NUM_WARMUP,
    SECTION_HEADING,
    Calibration,
    PolicyRun,
    RunSetup,
    SloBenchReport,
    render_section,
)
from tandem.cluster.launcher import ClusterConfig
from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tandem.router.config import RouterConfig

logger = logging.getLogger(__name__)

# Words per prompt: about 45 tokens with the presets' tokenizer.
PROMPT_WORDS = 40
# Prompt seeds: every phase gets its own prompts (no cross-phase prefix-cache hits).
_WARMUP_SEED, _UNLOADED_SEED, _PROBE_SEED, _TRACE_SEED = 1, 2, 100, 10_000
# The router's default `max_local_prefill_tokens` (conditional disaggregation on).
DEFAULT_LOCAL_PREFILL = RouterConfig.max_local_prefill_tokens
_REQUEST_TIMEOUT_S = 120.0
_START_TIMEOUT_S = 600.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--model", type=Path, help="default: models/tandem-<preset>")
    parser.add_argument("--out", default="docs/benchmarks.md", help="'' = print only")
    parser.add_argument("--json", type=Path, default=Path("bench/results/slo.json"))
    # Short outputs: here the decode worker shares the 2 cores with the prefill worker, and
    # long decodes would slow prefill down in a way no router can see (GPUs are not shared).
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--ttft-multiple", type=float, default=3.0, help="target / unloaded p50")
    parser.add_argument("--overload", type=float, default=2.0, help="offered / capacity")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    parser.add_argument("--probe-duration", type=float, default=10.0, help="at least")
    parser.add_argument(
        "--probe-requests", type=int, default=30, help="probes last long enough for this many"
    )
    parser.add_argument("--max-probes", type=int, default=7)
    parser.add_argument("--probe-step", type=float, default=1.3, help="rate factor per probe")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--local-prefill-run",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a third run: shed with the router's default conditional disaggregation",
    )
    parser.add_argument("--quick", action="store_true", help="short run to check the plumbing")
    args = parser.parse_args(argv)
    if args.model is None:
        args.model = Path(f"models/tandem-{args.preset}")
    if args.quick:
        args.duration, args.probe_duration, args.max_probes = 8.0, 4.0, 3
        args.probe_requests = 5
    return args


def cluster_config(
    args: argparse.Namespace, policy: str, ttft_target_s: float, local_prefill_tokens: int
) -> ClusterConfig:
    return ClusterConfig(
        model_dir=str(args.model),
        grpc_port=0,
        http_port=0,
        device="cpu",
        kv_backend="tcp",
        engine_overrides={"max_model_len": 1024},
        router_overrides={
            "admission_policy": policy,
            "ttft_slo_s": ttft_target_s,
            "itl_slo_s": ITL_OFF_S,
            "max_local_prefill_tokens": local_prefill_tokens,
        },
    )


def make_requests(args: argparse.Namespace, count: int, seed: int) -> list[gen_pb.GenerateRequest]:
    """`count` distinct short-prompt requests (no shared prefix: prefill does real work)."""
    return [
        gen_pb.GenerateRequest(
            prompt=prompt, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True
        )
        for prompt in distinct_prompts(count, PROMPT_WORDS, seed)
    ]


async def _num_prompt_tokens(endpoint: str, requests: list[gen_pb.GenerateRequest]) -> float:
    """Mean prompt length in tokens, by the router's own tokenizer."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        lengths = []
        for request in requests:
            reply = await stub.Tokenize(gen_pb.TokenizeRequest(prompt=request.prompt), timeout=10)
            lengths.append(len(reply.token_ids))
    return sum(lengths) / len(lengths)


def run_sequential(info: ClusterInfo, requests: list[gen_pb.GenerateRequest]) -> list:
    """One request at a time: warm-up (code paths, the router's latency models) or the
    unloaded baseline."""
    timings = asyncio.run(sequential(info.router_endpoint, requests, 60.0))
    failed = [t.error for t in timings if t.error]
    if failed:
        raise RuntimeError(f"sequential requests failed: {failed}")
    return timings


def run_trace(
    info: ClusterInfo,
    requests: list[gen_pb.GenerateRequest],
    arrivals: list[float],
    duration_s: float,
    ttft_target_s: float,
) -> RunSummary:
    start, timings = asyncio.run(
        open_loop(info.router_endpoint, requests, arrivals, _REQUEST_TIMEOUT_S)
    )
    outcomes = [outcome_of(t, start) for t in timings]
    return summarize(outcomes, duration_s, ttft_target_s)


def calibrate(args: argparse.Namespace) -> Calibration:
    # Admission `none`: the target only labels the router's metrics here.
    config = cluster_config(args, "none", ITL_OFF_S, 0)
    with ServerProcess("ray-cluster", serve_cluster, config) as cluster:
        info: ClusterInfo = cluster.start(_START_TIMEOUT_S)
        run_sequential(info, make_requests(args, NUM_WARMUP, _WARMUP_SEED))
        unloaded = make_requests(args, 16, _UNLOADED_SEED)
        num_prompt_tokens = asyncio.run(_num_prompt_tokens(info.router_endpoint, unloaded))
        timings = run_sequential(info, unloaded)
        ttft = LatencySummary.of([t.ttft_s for t in timings if t.ttft_s is not None])
        e2e = LatencySummary.of([t.e2e_s for t in timings])
        itls = [mean_itl_s(t.token_times_s) for t in timings]
        itl = LatencySummary.of([x for x in itls if x is not None])
        # Rounded up to 10 ms so the target reads as a round number.
        target = math.ceil(args.ttft_multiple * ttft.p50_s * 100) / 100
        logger.info("unloaded TTFT p50 %s; target %s", format_ms(ttft.p50_s), format_ms(target))
        # Start where the prefill worker would be ~30% busy with unloaded-TTFT requests.
        rate = 0.3 / ttft.p50_s
        probes: list[Probe] = []
        for i in range(args.max_probes):
            duration = max(args.probe_duration, args.probe_requests / rate)
            arrivals = poisson_arrivals(rate, duration, seed=_PROBE_SEED + i)
            requests = make_requests(args, len(arrivals), _PROBE_SEED + i)
            summary = run_trace(info, requests, arrivals, duration, target)
            probes.append(Probe(rate, summary))
            logger.info(
                "probe %.2f req/s: attainment %.0f%%, p50 TTFT %s",
                rate,
                summary.attainment * 100,
                format_ms(summary.ttft.p50_s),
            )
            if not probes[-1].passed(MIN_ATTAINMENT):
                break
            rate *= args.probe_step
    return Calibration(
        num_prompt_tokens=num_prompt_tokens,
        unloaded_ttft=ttft,
        unloaded_e2e=e2e,
        unloaded_itl=itl,
        ttft_target_s=target,
        probes=tuple(probes),
        capacity_per_s=capacity_of(probes, MIN_ATTAINMENT),
    )


def run_policy(
    args: argparse.Namespace,
    setup: RunSetup,
    target_s: float,
    arrivals: list[float],
    requests: list[gen_pb.GenerateRequest],
) -> PolicyRun:
    config = cluster_config(args, setup.policy, target_s, setup.local_prefill_tokens)
    with ServerProcess("ray-cluster", serve_cluster, config) as cluster:
        info: ClusterInfo = cluster.start(_START_TIMEOUT_S)
        run_sequential(info, make_requests(args, NUM_WARMUP, _WARMUP_SEED))
        load_start = load_average()
        summary = run_trace(info, requests, arrivals, args.duration, target_s)
        load_end = load_average()
        counters = scrape_counters(
            info.router_http,
            ("tandem:requests_rejected_total", "tandem:disagg_decisions_total"),
        )
    logger.info(
        "%s: admitted %.0f%%, attainment %.0f%%, goodput %.2f req/s",
        setup.label,
        summary.admitted_fraction * 100,
        summary.attainment * 100,
        summary.goodput,
    )
    return PolicyRun(setup, summary, counters, load_start, load_end)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shown = argv if argv is not None else sys.argv[1:]
    command = " ".join(["python -m bench.slo_bench", *shown])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    exit_on_sigterm()
    started = time.monotonic()
    facts = machine_facts()
    ensure_model(args.model, args.preset)
    calibration = calibrate(args)
    capacity = calibration.capacity_per_s
    if capacity is None:
        # Even the lightest probe missed: overload relative to that one.
        capacity = calibration.probes[0].rate_per_s / args.probe_step
        logger.warning("no probe met the target; using %.2f req/s as capacity", capacity)
    offered = args.overload * capacity
    arrivals = poisson_arrivals(offered, args.duration, seed=args.seed)
    requests = make_requests(args, len(arrivals), _TRACE_SEED + args.seed)
    setups = [RunSetup("shed", "shed"), RunSetup("none", "none")]
    if args.local_prefill_run:
        setups.append(RunSetup("shed, default local prefill", "shed", DEFAULT_LOCAL_PREFILL))
        setups.append(RunSetup("none, default local prefill", "none", DEFAULT_LOCAL_PREFILL))
    runs = tuple(
        run_policy(args, setup, calibration.ttft_target_s, arrivals, requests) for setup in setups
    )
    report = SloBenchReport(
        command=command,
        wall_s=time.monotonic() - started,
        machine=facts,
        load_average_end=load_average(),
        model=args.preset,
        max_tokens=args.max_tokens,
        calibration=calibration,
        offered_rate_per_s=offered,
        duration_s=args.duration,
        seed=args.seed,
        runs=runs,
    )
    write_json(args.json, report)
    section = render_section(report)
    print(f"{SECTION_HEADING}\n\n{section}")
    if args.out:
        write_section(Path(args.out), SECTION_HEADING, section)


if __name__ == "__main__":
    main()
