"""Elastic pools under load: time to heal after kill -9, the stall of migrated streams,
drain time (`tandem-bench pools`).

Starts `tandem serve --prefill 1 --decode 2 --restart-backoff 0` on the CPU, sends
steady greedy streams over fixed prompts, kills the busiest decode worker `--kills`
times (timing detection and healing through `/admin/pools`), then scales decode down
by one `--drains` times (timing until the drained worker stops). Migrated streams are
found in the router's log ("migrating after N tokens"); each one's gap at the switch is
compared with its own median inter-token time, and every text with an uninterrupted
run of its prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import statistics
import time
from dataclasses import dataclass

import numpy as np

from tandem.bench import report
from tandem.bench.harness import ensure_model, free_port, running, tandem_spec
from tandem.bench.loadgen.clients import ClientConfig, GrpcClient
from tandem.bench.loadgen.metrics import Distribution, itl_gaps_s, ttft_s
from tandem.bench.loadgen.traces import RequestTrace
from tandem.bench.loadgen.workloads import RequestSpec
from tandem.bench.pools import scenario
from tandem.bench.pools.scenario import PoolEvent

SECTION_HEADING = "## Elastic pools: healing, migration, drain"
FULL_COMMAND = ".venv/bin/tandem-bench pools --kills 5 --drains 3"
# No restart backoff: the kills come every few seconds, of young workers, on purpose;
# the heal time measured is the controller's and a worker start's, not a hold.
SERVE_FLAGS = ("--prefill", "1", "--decode", "2", "--device", "cpu", "--kv-backend", "tcp",
               "--max-model-len", "1024", "--restart-backoff", "0")  # fmt: skip
# What the router logs when it moves a request (router/sequence_flow.py).
_MIGRATION = re.compile(r"request (\S+): worker \S+ failed \(.*; migrating after (\d+) tokens")
MIN_MEASURED_KILLS = 5


@dataclass(frozen=True)
class Migration:
    req_id: str
    num_streamed: int  # tokens the client had before the switch
    stall_s: float  # the gap at the switch (TTFT when it moved before its first token)
    usual_s: float  # the stream's median inter-token gap (the median TTFT for a TTFT)
    same_text: bool  # equal to an uninterrupted greedy run of its prompt


def same_text(trace: RequestTrace, reference: list[list[int]]) -> bool:
    return trace.ok and trace.token_ids == reference[int(trace.req_id.rsplit("-p", 1)[1])]


def migrations(log: str, traces: list[RequestTrace], reference: list[list[int]]) -> list[Migration]:
    by_id = {t.req_id: t for t in traces}
    ttfts = [s for t in traces if t.ok and (s := ttft_s(t)) is not None] or [math.nan]
    found = []
    for req_id, num in _MIGRATION.findall(log):
        trace, n = by_id.get(req_id), int(num)
        if trace is None or n >= len(trace.token_times_s):
            continue  # not a load stream, or it failed at the switch
        times = trace.token_times_s
        if n == 0:
            stall, usual = times[0] - trace.send_s, statistics.median(ttfts)
        else:
            stall, usual = times[n] - times[n - 1], statistics.median(itl_gaps_s(trace))
        found.append(Migration(req_id, n, stall, usual, same_text(trace, reference)))
    return found


async def measure(args: argparse.Namespace, grpc_target: str, http_url: str) -> dict:
    client = GrpcClient(ClientConfig(grpc_target))
    info = await client.start()
    rng = np.random.default_rng(0)
    prompts = [tuple(int(i) for i in rng.integers(10, info.vocab_size or 2048, n))
               for n in rng.integers(16, 200, args.prompts)]  # fmt: skip
    try:
        # Uninterrupted runs, one per prompt: what every stream's text must equal.
        alone = await asyncio.gather(*(client.stream(RequestSpec(f"ref-p{i}", p, args.max_tokens))
                                       for i, p in enumerate(prompts)))  # fmt: skip
        if failed := [t.error for t in alone if not t.ok]:
            raise RuntimeError(f"reference runs failed: {failed}")
        stop = asyncio.Event()
        load = asyncio.create_task(
            scenario.steady_load(client, prompts, args.max_tokens, args.concurrency, stop)
        )
        try:
            kills = await scenario.kill_decode_workers(http_url, args.kills, args.settle)
            drains = await scenario.drain_decode_workers(http_url, args.drains, args.settle)
        finally:
            stop.set()
            traces = await asyncio.wait_for(load, 300.0)
    finally:
        await client.close()
    reference = [t.token_ids for t in alone]
    return {"traces": traces, "reference": reference, "kills": kills, "drains": drains}


def row(what: str, values: list[float]) -> list[str]:
    d = Distribution.of(values)
    return [what, str(d.count), *("—" if math.isnan(v) else f"{v:.2f} s" for v in (d.p50, d.max))]


def results_block(args, kills: list[PoolEvent], drains: list[PoolEvent], moved: list[Migration],
                  traces: list[RequestTrace], reference: list[list[int]]) -> str:  # fmt: skip
    failed = [t for t in traces if not t.ok]
    in_drains = [t for t in failed for d in drains if d.at_s <= t.end_s <= d.at_s + d.took_s]
    wrong = [t for t in traces if t.ok and not same_text(t, reference)]
    table = report.render_table(["measure", "n", "p50", "max"], [
        row("heal: kill -9 → decode pool back at target, serving", [k.took_s for k in kills]),
        row("detection: kill -9 → controller lists the worker dead", [k.detected_s for k in kills]),
        row("migrated stream: gap at the switch", [m.stall_s for m in moved]),
        row("migrated stream: gap minus its median ITL (TTFT if unstarted)",
            [m.stall_s - m.usual_s for m in moved]),
        row("drain: scale-down call → drained worker stopped", [d.took_s for d in drains]),
    ])  # fmt: skip
    smoke = len(kills) < MIN_MEASURED_KILLS
    return (
        ("**Smoke run, loaded machine: not a measurement.** " if smoke else "")
        + f"`tandem serve --prefill 1 --decode 2 --restart-backoff 0` (CPU, KV over TCP), "
        f"`{args.model}`; "
        f"{args.concurrency} greedy streams of {args.max_tokens} tokens over {args.prompts} "
        f"prompts; kills of the busiest decode worker: {len(kills)}; drains: {len(drains)}."
        f"\n\n{table}\n\nRequests: {len(traces)}, failed {len(failed)} (during drains: "
        f"{len(in_drains)}); texts differing from an uninterrupted run: {len(wrong)}. "
        f"Migrations: {len(moved)}, text equal to an uninterrupted run: "
        f"{sum(m.same_text for m in moved)}/{len(moved)}."
    )


def main(args: argparse.Namespace) -> int:
    model_dir = ensure_model(args.model, args.preset)
    facts, started = report.machine_facts(), time.perf_counter()
    spec = tandem_spec("tandem 1P+2D", str(model_dir), free_port(), free_port(), SERVE_FLAGS)
    with running([spec], args.json.parent / "pools-logs") as [server]:
        assert spec.grpc_target is not None
        found = asyncio.run(measure(args, spec.grpc_target, spec.http_url))
        log = server.log_path.read_text("utf-8", "replace")
    traces, reference = found["traces"], found["reference"]
    moved = migrations(log, traces, reference)
    machine = report.machine_sentence(facts, os.getloadavg())
    report.publish(args.out, SECTION_HEADING, [
        report.run_block(FULL_COMMAND, args.command, time.perf_counter() - started, machine),
        results_block(args, found["kills"], found["drains"], moved, traces, reference),
    ])  # fmt: skip
    results = {"machine": facts, "migrations": moved}
    report.write_json(args.json, {**results, "kills": found["kills"], "drains": found["drains"]})
    return 1 if any(not t.ok for t in traces) or not all(m.same_text for m in moved) else 0
