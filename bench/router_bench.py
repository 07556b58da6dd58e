"""Router overhead: added latency per request, and requests/s one router core sustains.

    PYTHONPATH=. .venv/bin/python -m bench.router_bench [--out docs/benchmarks.md]

Part 1, *added latency*: a Ray `LocalCluster` (tiny model; prefill and decode workers as
Ray actors, router in a child process) and, from this process, N sequential requests
alternately via the router's `Generate` and straight to the workers
(`bench.router_overhead`). Part 2, *throughput*: instant fake workers in one process,
a router pinned to one core in another, and a closed-loop load generator in a third
(`bench.router_fake_workers`, `bench.router_load`). Writes `## Router overhead` of
docs/benchmarks.md and raw numbers to bench/results/router.json.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.bench.doc_sections import write_section
from tandem.bench.router_cluster import ClusterInfo, ensure_model, serve_cluster
from tandem.bench.router_fake_workers import RouterArgs, serve_fake_workers, serve_router
from tandem.bench.router_load import ClosedLoopArgs, ClosedLoopResult, closed_loop
from tandem.bench.router_overhead import OverheadResult, measure_overhead
from tandem.bench.router_procs import ServerProcess, exit_on_sigterm, run_job
from tandem.bench.router_report import (
    MachineFacts,
    format_ms,
    format_table,
    load_average,
    machine_facts,
    write_json,
)
from tandem.cluster.launcher import ClusterConfig
from tandem.router.config import RouterConfig

logger = logging.getLogger(__name__)

SECTION_HEADING = "## Router overhead"
FULL_COMMAND = "PYTHONPATH=. .venv/bin/python -m bench.router_bench"
PROMPT = "The router picks a prefill worker and a decode worker for every request."
# Below this share of its core the router was not what limited throughput.
SATURATED_CPU = 0.9


@dataclass(frozen=True)
class ThroughputSetup:
    # Cores the router process was pinned to, and those the other processes shared.
    router_cores: tuple[int, ...]
    other_cores: tuple[int, ...]
    pinned: bool


@dataclass(frozen=True)
class RouterBenchReport:
    command: str
    wall_s: float
    machine: MachineFacts
    load_average_end: tuple[float, float, float]
    overhead: OverheadResult
    setup: ThroughputSetup
    throughput: tuple[ClosedLoopResult, ...]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/tandem-tiny"))
    parser.add_argument("--out", default="docs/benchmarks.md", help="'' = print only")
    parser.add_argument("--json", type=Path, default=Path("bench/results/router.json"))
    parser.add_argument("--requests", type=int, default=200, help="sequential requests per path")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per level")
    parser.add_argument("--quick", action="store_true", help="tiny run to check the plumbing")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.warmup, args.duration = 20, 2, 3.0
    return args


def measure_added_latency(args: argparse.Namespace) -> OverheadResult:
    config = ClusterConfig(
        model_dir=str(args.model),
        grpc_port=0,
        http_port=0,
        device="cpu",
        kv_backend="tcp",
        engine_overrides={"kv_cache_memory_bytes": 256 << 20, "max_model_len": 1024},
        # Always disaggregate: the direct path is Prefill then Decode, so must the router be.
        router_overrides={"max_local_prefill_tokens": 0},
    )
    with ServerProcess("ray-cluster", serve_cluster, config) as cluster:
        info: ClusterInfo = cluster.start(timeout_s=600)
        logger.info("cluster up: router %s", info.router_endpoint)
        return asyncio.run(
            asyncio.wait_for(
                measure_overhead(info, PROMPT, args.requests, args.max_tokens, args.warmup),
                timeout=600,
            )
        )


def throughput_setup() -> ThroughputSetup:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 2:
        return ThroughputSetup((), (), pinned=False)
    return ThroughputSetup((cores[0],), tuple(cores[1:]), pinned=True)


def measure_throughput(
    args: argparse.Namespace, setup: ThroughputSetup
) -> tuple[ClosedLoopResult, ...]:
    router_config = RouterConfig(
        model_dir=str(args.model), grpc_port=0, http_port=0, max_local_prefill_tokens=0
    )
    results = []
    with ServerProcess("fake-workers", serve_fake_workers, None, setup.other_cores) as fakes:
        workers = fakes.start(timeout_s=60)
        router_args = RouterArgs(router_config, workers)
        with ServerProcess("router", serve_router, router_args, setup.router_cores) as router:
            endpoint = router.start(timeout_s=120)
            for concurrency in args.concurrency:
                load = ClosedLoopArgs(
                    endpoint=endpoint,
                    concurrency=concurrency,
                    warmup_s=2.0,
                    duration_s=args.duration,
                    prompt=PROMPT,
                    max_tokens=args.max_tokens,
                    watch_pids={"router": router.pid, "fake workers": fakes.pid},
                )
                timeout = args.duration + 120
                result = run_job(closed_loop, load, timeout_s=timeout, cores=setup.other_cores)
                logger.info("concurrency %d: %.0f req/s", concurrency, result.requests_per_s)
                results.append(result)
    return tuple(results)


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def render_overhead(result: OverheadResult) -> str:
    rows = []
    for name, routed, direct, added in (
        ("TTFT", result.router_ttft, result.direct_ttft, result.added_ttft),
        ("end-to-end", result.router_e2e, result.direct_e2e, result.added_e2e),
    ):
        rows.append(
            [
                name,
                format_ms(routed.p50_s),
                format_ms(routed.p99_s),
                format_ms(direct.p50_s),
                format_ms(direct.p99_s),
                format_ms(added.p50_s),
                format_ms(added.p99_s),
            ]
        )
    headers = [
        "latency",
        "via router p50",
        "p99",
        "direct p50",
        "p99",
        "added p50",
        "added p99",
    ]
    return format_table(headers, rows)


def render_throughput(results: tuple[ClosedLoopResult, ...]) -> str:
    rows = []
    for r in results:
        cpu = r.cpu_utilization
        errors = ", ".join(f"{k} {v}" for k, v in sorted(r.errors.items())) or "0"
        rows.append(
            [
                str(r.concurrency),
                f"{r.requests_per_s:,.0f}",
                format_ms(r.latency.p50_s),
                format_ms(r.latency.p99_s),
                format_ms(r.ttft.p50_s),
                _percent(cpu.get("router")),
                _percent(cpu.get("fake workers")),
                _percent(cpu.get("load generator")),
                errors,
            ]
        )
    headers = [
        "concurrency",
        "requests/s",
        "p50 latency",
        "p99 latency",
        "p50 TTFT",
        "router CPU",
        "fake workers CPU",
        "load generator CPU",
        "errors",
    ]
    return format_table(headers, rows)


def overhead_reading(result: OverheadResult) -> str:
    share = result.added_e2e.p50_s / result.direct_e2e.p50_s
    match = (
        "Both paths produced the same greedy tokens for every request."
        if result.outputs_match
        else "**The two paths produced different tokens for some requests.**"
    )
    return (
        f"Going through the router adds {format_ms(result.added_e2e.p50_s)} to the median "
        f"request ({share:.0%} of the direct path's {format_ms(result.direct_e2e.p50_s)}) and "
        f"{format_ms(result.added_ttft.p50_s)} to the median TTFT; the p99 of the paired "
        f"differences is {format_ms(result.added_e2e.p99_s)} end to end. That is one more "
        "gRPC hop each way (client → router → worker) plus the router's own work: "
        "validation and tokenization, the policy's placement, and re-streaming every "
        f"message. {match}"
    )


def throughput_reading(results: tuple[ClosedLoopResult, ...], setup: ThroughputSetup) -> str:
    best = max(results, key=lambda r: r.requests_per_s)
    router_cpu = best.cpu_utilization.get("router")
    where = (
        f"pinned to core {setup.router_cores[0]}"
        if setup.pinned
        else "unpinned (sched_setaffinity unavailable or one core)"
    )
    text = (
        f"One router process ({where}) served up to {best.requests_per_s:,.0f} requests/s "
        f"(concurrency {best.concurrency}, p50 {format_ms(best.latency.p50_s)}, p99 "
        f"{format_ms(best.latency.p99_s)}); each request is a `Generate` stream in, a "
        "`Prefill` call and a `Decode` stream out."
    )
    if router_cpu is None:
        return text + " The router's CPU use could not be read."
    cost = f"{router_cpu / best.requests_per_s * 1e3:.1f} ms"
    if router_cpu >= SATURATED_CPU:
        return (
            text + f" The router used {router_cpu:.0%} of its core ({cost} of CPU per "
            "request), so this is the router's own limit on this machine."
        )
    return (
        text + f" The router used only {router_cpu:.0%} of its core: the fake workers and "
        "the load generator, which share the other core(s), limited the rate, so the "
        f"router's own ceiling is higher; about {best.requests_per_s / router_cpu:,.0f} "
        f"requests/s per fully busy core at its measured {cost} of CPU per request."
    )


# From one cProfile run of the router process (concurrency 64, fake workers, 2026-11-29).
PROFILE_NOTE = (
    "**Where the router's CPU goes** (one `cProfile` run of the router process at "
    "concurrency 64, not regenerated by the command above): placement "
    "(`GoodputPolicy.place`) ≈ 10% of the router's time, half of it the prefill latency "
    "model's refit (`LinearLatencyModel._fit_window`, small numpy solves, redone after "
    "every observation, i.e. once per request); tokenization ≈ 4%; Prometheus label "
    "lookups ≈ 2%; the rest is grpc.aio and asyncio machinery for the three RPCs of each "
    "request (`Generate` in, `Prefill` and `Decode` out). Cheaper per-request Python in "
    "the policy would buy little; fewer RPC messages (or more router processes) would."
)


def render_section(report: RouterBenchReport) -> str:
    o = report.overhead
    setup = report.setup
    pin = (
        f"router pinned to core {', '.join(map(str, setup.router_cores))}; fake workers and "
        f"load generator on core(s) {', '.join(map(str, setup.other_cores))}"
        if setup.pinned
        else "no pinning (fewer than 2 cores or no sched_setaffinity)"
    )
    concurrency = ", ".join(str(r.concurrency) for r in report.throughput)
    duration = report.throughput[0].duration_s if report.throughput else 0.0
    lines = [
        "Command (full run, from the repository root):",
        "",
        "```",
        FULL_COMMAND,
        "```",
        "",
        f"This run: `{report.command}` ({report.wall_s / 60:.1f} min).",
        "",
        report.machine.sentence(report.load_average_end),
        "",
        "### Added latency per request",
        "",
        "**Method.** `tiny` preset on a Ray `LocalCluster` (`cluster/launcher.py`): the "
        "prefill and the decode worker are Ray actors, each its own process with 1 torch "
        "thread, KV over TCP; the router runs in another child process, the client in the "
        f"benchmark process. {o.num_requests} sequential requests per path (after a "
        f"warm-up), one prompt of {o.num_prompt_tokens} tokens (the same each time, so "
        "both paths hit the workers' prefix cache alike), "
        f"`max_tokens={o.max_tokens}`, greedy, `ignore_eos`. *Via router*: `Generate` "
        "with the text prompt (so the router tokenizes it). *Direct*: the same token ids, "
        "`PrefillWorker.Prefill` then `DecodeWorker.Decode` with the returned `KvHandle`, "
        "issued by the client exactly "
        "as `RequestFlow` issues them. The router runs with `max_local_prefill_tokens=0`, "
        "so it always disaggregates onto the same worker pair. The paths alternate (and "
        "swap which goes first) so load drift hits both; *added* = per-pair difference "
        "router − direct. TTFT = until the first token; end-to-end = until the last "
        "message.",
        "",
        render_overhead(o),
        "",
        overhead_reading(o),
        "",
        "### Router throughput with instant fake workers",
        "",
        "**Method.** Fake `PrefillWorker` / `DecodeWorker` gRPC servers "
        "(`bench/router_fake_workers.py`, one process) answer at once: `Prefill` returns "
        "a first token and a dummy `KvHandle`, `Decode` streams the other "
        f"{o.max_tokens - 1} tokens in one message (no KV is pulled), `Stats`/health "
        "report an idle worker. A real router (default settings but "
        "`max_local_prefill_tokens=0`, admission `none`, Stats polled every 0.25 s) runs "
        f"in its own process; {pin}. A closed-loop load generator (own process, one "
        "gRPC channel) keeps *concurrency* `Generate` streams in flight (text prompt, "
        f"`max_tokens={o.max_tokens}`) for 2 s of warm-up and {duration:g} s measured; "
        "requests/s and latencies count the requests that finished in the measured "
        "window. CPU = CPU seconds each process used per second of that window "
        f"(100% = one core). Levels: {concurrency}.",
        "",
        render_throughput(report.throughput),
        "",
        throughput_reading(report.throughput, setup),
        "",
        PROFILE_NOTE,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shown = argv if argv is not None else sys.argv[1:]
    command = " ".join(["python -m bench.router_bench", *shown])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    exit_on_sigterm()
    started = time.monotonic()
    facts = machine_facts()
    ensure_model(args.model, "tiny")
    overhead = measure_added_latency(args)
    logger.info("added latency p50 %s", format_ms(overhead.added_e2e.p50_s))
    setup = throughput_setup()
    throughput = measure_throughput(args, setup)
    report = RouterBenchReport(
        command=command,
        wall_s=time.monotonic() - started,
        machine=facts,
        load_average_end=load_average(),
        overhead=overhead,
        setup=setup,
        throughput=throughput,
    )
    write_json(args.json, report)
    section = render_section(report)
    print(f"{SECTION_HEADING}\n\n{section}")
    if args.out:
        write_section(Path(args.out), SECTION_HEADING, section)


if __name__ == "__main__":
    main()
