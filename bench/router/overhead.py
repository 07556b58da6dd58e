"""Router overhead: added latency per request, and requests/s one router core sustains."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import grpc

from tandem.bench.harness import (
    ServerSpec,
    cpu_pair_spec,
    ensure_model,
    free_port,
    process_cpu_s,
    running,
)
from tandem.bench.loadgen.clients import ClientConfig, GrpcClient
from tandem.bench.loadgen.load import LoadConfig, run_load
from tandem.bench.loadgen.metrics import Distribution, e2e_s, ttft_s
from tandem.bench.loadgen.traces import RequestTrace
from tandem.bench.loadgen.workloads import TextPrompts
from tandem.bench.report import (
    format_ms,
    machine_facts,
    machine_sentence,
    publish,
    render_table,
    run_block,
    write_json,
)
from tandem.engine.sampling_params import SamplingParams
from tandem.proto.cluster_auth import TOKEN_ENV, ClusterAuth, internal_channel
from tandem.proto.server_options import GRPC_OPTIONS
from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc
from tandem.worker.convert import sampling_params_to_proto

logger = logging.getLogger(__name__)

SECTION_HEADING = "## Router overhead"
FULL_COMMAND = ".venv/bin/tandem-bench router"
PROMPT = "The router picks a prefill worker and a decode worker for every request."
WARMUP_S = 2.0
_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class OverheadResult:
    num_requests: int
    num_prompt_tokens: int
    max_tokens: int
    router_e2e: Distribution
    direct_e2e: Distribution
    router_ttft: Distribution
    direct_ttft: Distribution
    added_e2e: Distribution  # per pair: router minus direct
    added_ttft: Distribution
    outputs_match: bool  # both paths produced the same greedy tokens for every request


@dataclass(frozen=True)
class ThroughputResult:
    concurrency: int
    duration_s: float
    num_completed: int  # requests that finished inside the measured window
    errors: dict[str, int]  # failed requests inside the window, by status
    requests_per_s: float
    latency: Distribution
    ttft: Distribution
    cpu_utilization: dict[str, float]  # name -> CPU s per s of the window (1.0 = one core)


def paired_differences(slow: list[float], fast: list[float]) -> list[float]:
    """`slow[i] - fast[i]` for requests measured in pairs (interleaved runs)."""
    if len(slow) != len(fast):
        raise ValueError(f"unpaired samples: {len(slow)} vs {len(fast)}")
    return [a - b for a, b in zip(slow, fast, strict=True)]


async def direct_generate(
    prefill: worker_pb2_grpc.PrefillWorkerStub,
    decode: worker_pb2_grpc.DecodeWorkerStub,
    prompt_ids: list[int],
    params: pb.SamplingParams,
) -> RequestTrace:
    """Prefill then Decode with the handle, as `RequestFlow` does for a disaggregated pair."""
    req_id = uuid.uuid4().hex
    start = time.perf_counter()
    reply = await prefill.Prefill(
        pb.PrefillRequest(request_id=req_id, prompt_token_ids=prompt_ids, params=params),
        timeout=_TIMEOUT_S,
    )
    times, ids = [time.perf_counter()], [reply.first_token_id]
    finished = reply.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    if not finished:
        request = pb.DecodeRequest(
            request_id=req_id, prompt_token_ids=prompt_ids, params=params,
            kv_handle=reply.kv_handle, first_token_id=reply.first_token_id,
        )  # fmt: skip
        async for msg in decode.Decode(request, timeout=_TIMEOUT_S):
            times += [time.perf_counter()] * len(msg.token_ids)
            ids += msg.token_ids
            finished = finished or msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    return RequestTrace(
        req_id, "direct", len(prompt_ids), params.max_tokens, start, time.perf_counter(),
        times, len(ids), error="" if finished else "stream ended without a finish reason",
        token_ids=ids,
    )  # fmt: skip


async def measure_overhead(
    target: str,
    workers: dict[str, str],
    auth: ClusterAuth,
    num_requests: int,
    max_tokens: int,
    num_warmup: int,
) -> OverheadResult:
    """`auth`: the cluster token the workers require (the direct path calls them)."""
    router = GrpcClient(ClientConfig(target, prompt_format="text", request_timeout_s=_TIMEOUT_S))
    await router.start()
    async with (
        grpc.aio.insecure_channel(target.removeprefix("grpc://"), options=GRPC_OPTIONS) as r_ch,
        internal_channel(workers["prefill"], auth) as p_channel,
        internal_channel(workers["decode"], auth) as d_channel,
    ):
        # The ids the router's tokenizer makes of the prompt: both paths prefill the same.
        tokenize = generation_pb2_grpc.GenerationStub(r_ch).Tokenize
        reply = await tokenize(gen_pb.TokenizeRequest(prompt=PROMPT), timeout=10)
        prompt_ids = list(reply.token_ids)
        prefill = worker_pb2_grpc.PrefillWorkerStub(p_channel)
        decode = worker_pb2_grpc.DecodeWorkerStub(d_channel)
        params = sampling_params_to_proto(
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        )
        workload = TextPrompts(0, max_tokens, text=PROMPT)
        routed: list[RequestTrace] = []
        straight: list[RequestTrace] = []
        try:
            for i in range(num_warmup + num_requests):
                via_router = router.stream(workload.request(i))
                direct = direct_generate(prefill, decode, prompt_ids, params)
                if i % 2 == 0:  # alternate which path goes first
                    r, d = await via_router, await direct
                else:
                    d, r = await direct, await via_router
                for t in (r, d):
                    if t.error:
                        raise RuntimeError(f"request failed: {t.error}")
                if i >= num_warmup:
                    routed.append(r)
                    straight.append(d)
        finally:
            await router.close()
    r_e2e, d_e2e = [e2e_s(t) for t in routed], [e2e_s(t) for t in straight]
    r_ttft, d_ttft = _ttfts(routed), _ttfts(straight)
    of = Distribution.of
    return OverheadResult(
        num_requests, len(prompt_ids), max_tokens, of(r_e2e), of(d_e2e), of(r_ttft), of(d_ttft),
        of(paired_differences(r_e2e, d_e2e)), of(paired_differences(r_ttft, d_ttft)),
        all(r.token_ids == d.token_ids for r, d in zip(routed, straight, strict=True)),
    )  # fmt: skip


def _ttfts(traces: list[RequestTrace]) -> list[float]:
    return [x for x in map(ttft_s, traces) if x is not None]


def throughput_of(
    traces: list[RequestTrace],
    concurrency: int,
    window: tuple[float, float],
    cpu: tuple[dict[str, float | None], dict[str, float | None]],
) -> ThroughputResult:
    """What finished inside `window` (s from the run's start), and each process's CPU
    use over it from /proc samples at its start and end."""
    start, end = window
    duration = end - start
    inside = [t for t in traces if start <= t.end_s <= end]
    done = [t for t in inside if t.ok]
    errors = Counter(t.error.split(":")[0] for t in inside if not t.ok)
    before, after = cpu
    used = {
        name: (a - b) / duration
        for name in before
        if (b := before[name]) is not None and (a := after.get(name)) is not None
    }
    return ThroughputResult(
        concurrency, duration, len(done), dict(errors), len(done) / duration,
        Distribution.of([e2e_s(t) for t in done]), Distribution.of(_ttfts(done)), used,
    )  # fmt: skip


async def closed_loop(
    target: str, concurrency: int, duration_s: float, max_tokens: int, pids: dict[str, int]
) -> ThroughputResult:
    """`concurrency` streams kept in flight over one channel for `WARMUP_S` + `duration_s`."""
    pids = {**pids, "load generator": os.getpid()}
    client = GrpcClient(ClientConfig(target, prompt_format="text", request_timeout_s=30.0))
    await client.start()
    loop = asyncio.get_running_loop()

    async def sample_cpu(at_s: float) -> dict[str, float | None]:
        await asyncio.sleep(max(0.0, at_s - loop.time()))
        return {name: process_cpu_s(pid) for name, pid in pids.items()}

    try:
        now = loop.time()
        cpu_start = asyncio.ensure_future(sample_cpu(now + WARMUP_S))
        cpu_end = asyncio.ensure_future(sample_cpu(now + WARMUP_S + duration_s))
        total_s = WARMUP_S + duration_s
        config = LoadConfig(concurrency, duration_s=total_s, timeout_s=total_s + 60, progress=False)
        result = await run_load(client, TextPrompts(0, max_tokens, text=PROMPT), config)
        cpu = (await cpu_start, await cpu_end)
    finally:
        await client.close()
    return throughput_of(result.traces, concurrency, (WARMUP_S, WARMUP_S + duration_s), cpu)


def cores_split() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(router's core, everyone else's); both empty when there are fewer than 2 cores."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return ((cores[0],), tuple(cores[1:])) if len(cores) >= 2 else ((), ())


def measure_added_latency(args: argparse.Namespace) -> OverheadResult:
    # Always disaggregate: the direct path is Prefill then Decode, so must the router be.
    spec = cpu_pair_spec("router-bench-cluster", args.model, ("--max-local-prefill-tokens", "0"))
    # The workers require the cluster's token of every call: the direct path's calls too.
    auth = ClusterAuth(token=secrets.token_hex(32))
    assert auth.token is not None
    spec.env[TOKEN_ENV] = auth.token
    with running([spec], args.json.parent / "logs") as (cluster,):
        workers = cluster.worker_endpoints()
        target = spec.grpc_target or ""
        measure = measure_overhead(
            target, workers, auth, args.requests, args.max_tokens, args.warmup
        )
        return asyncio.run(asyncio.wait_for(measure, timeout=600))


def measure_throughput(args: argparse.Namespace) -> tuple[ThroughputResult, ...]:
    router_cores, other_cores = cores_split()
    prefill_port, decode_port, grpc_port, http_port = (free_port() for _ in range(4))
    module = (sys.executable, "-m", "tandem.bench.router.fake_workers")
    ports = ("--prefill-port", str(prefill_port), "--decode-port", str(decode_port))
    fakes = ServerSpec("fake-workers", (*module, "workers", *ports),
                       f"tcp://127.0.0.1:{decode_port}", cores=other_cores)  # fmt: skip
    router_argv = (*module, "router", *ports, "--model", str(args.model), "--grpc-port",
                   str(grpc_port), "--http-port", str(http_port))  # fmt: skip
    router = ServerSpec("fake-router", router_argv, f"http://127.0.0.1:{http_port}/v1/models",
                        cores=router_cores)  # fmt: skip
    results = []
    affinity = os.sched_getaffinity(0) if other_cores else set()
    with running([fakes, router], args.json.parent / "logs") as (fake_proc, router_proc):
        pids = {"router": router_proc.pid, "fake workers": fake_proc.pid}
        try:
            if other_cores:
                os.sched_setaffinity(0, set(other_cores))
            for concurrency in args.concurrency:
                target = f"grpc://127.0.0.1:{grpc_port}"
                load = closed_loop(target, concurrency, args.duration, args.max_tokens, pids)
                result = asyncio.run(asyncio.wait_for(load, timeout=args.duration + 120))
                logger.info("concurrency %d: %.0f req/s", concurrency, result.requests_per_s)
                results.append(result)
        finally:
            if affinity:
                os.sched_setaffinity(0, affinity)
    return tuple(results)


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def render_overhead(result: OverheadResult) -> str:
    rows = [
        [name, *(format_ms(x) for d in dists for x in (d.p50, d.p99))]
        for name, dists in (
            ("TTFT", (result.router_ttft, result.direct_ttft, result.added_ttft)),
            ("end-to-end", (result.router_e2e, result.direct_e2e, result.added_e2e)),
        )
    ]
    header = ["latency", "via router p50", "p99", "direct p50", "p99", "added p50", "added p99"]
    return render_table(header, rows)


_PROCESSES = ("router", "fake workers", "load generator")


def render_throughput(results: tuple[ThroughputResult, ...]) -> str:
    rows = [
        [str(r.concurrency), f"{r.requests_per_s:,.0f}", format_ms(r.latency.p50),
         format_ms(r.latency.p99), format_ms(r.ttft.p50),
         *(_percent(r.cpu_utilization.get(name)) for name in _PROCESSES),
         ", ".join(f"{k} {v}" for k, v in sorted(r.errors.items())) or "0"]
        for r in results
    ]  # fmt: skip
    header = ["concurrency", "requests/s", "p50 latency", "p99 latency", "p50 TTFT"]
    return render_table([*header, *(f"{name} CPU" for name in _PROCESSES), "errors"], rows)


def render_section(report: dict[str, Any]) -> list[str]:
    """The generated blocks: the run and its machine; added latency; throughput."""
    o: OverheadResult = report["overhead"]
    throughput: tuple[ThroughputResult, ...] = report["throughput"]
    router_cores, other_cores = report["cores"]
    pin = (
        f"router on core {', '.join(map(str, router_cores))}, fake workers and load generator "
        f"on core(s) {', '.join(map(str, other_cores))}"
        if router_cores
        else "no pinning"
    )
    match = "the same" if o.outputs_match else "**different**"
    machine = machine_sentence(report["machine"], report["load_average_end"])
    overhead = [
        f"{o.num_requests} sequential requests per path, a {o.num_prompt_tokens}-token prompt, "
        f"`max_tokens={o.max_tokens}`; both paths produced {match} greedy tokens.",
        "",
        render_overhead(o),
    ]
    levels = ", ".join(str(r.concurrency) for r in throughput)
    duration = throughput[0].duration_s if throughput else 0.0
    loaded = [
        f"Concurrency {levels}; {WARMUP_S:g} s warm-up, {duration:g} s measured; {pin}.",
        "",
        render_throughput(throughput),
    ]
    run = run_block(FULL_COMMAND, report["command"], report["wall_s"], machine)
    return [run, "\n".join(overhead), "\n".join(loaded)]


def main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    facts = machine_facts()
    ensure_model(args.model, "tiny")
    overhead = measure_added_latency(args)
    logger.info("added latency p50 %s", format_ms(overhead.added_e2e.p50))
    report = {
        "command": args.command,
        "machine": facts,
        "overhead": overhead,
        "cores": cores_split(),
        "throughput": measure_throughput(args),
    }
    report["wall_s"] = time.monotonic() - started
    report["load_average_end"] = os.getloadavg()
    write_json(args.json, report)
    publish(args.out, SECTION_HEADING, render_section(report), write=not args.quick)
    return 0
