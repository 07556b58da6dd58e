"""`tandem-bench topology`: `make serve`'s default topology against `transformers serve`.

Starts exactly what `make serve` starts (`tandem serve --model DIR`, every default: the
pools, the thread policy, `--dtype auto`, the conditional-disaggregation threshold) on
free ports, and `transformers serve --continuous-batching` on the same model, with the
dtype Tandem's `auto` resolves to here and as many KV blocks as one Tandem worker's
default pool. Both keep torch's thread defaults for this machine (Tandem: its thread
policy; the peer: torch's default, all cores). Optional variants (`--variants split`,
`colocated-1`, ...) are more `tandem serve` flag sets measured the same way.

One server at a time, so an idle one (Ray's daemons, the engine loops' idle wake-ups)
never shares the cores with a measured one; each round starts every system once and
runs every concurrency level on it, and the order of systems alternates between rounds
so the machine's drift falls on all alike. The section reports, per system and level,
the median over rounds of output tokens/s, TTFT p50 and ITL p50, and the ratio of the
medians to the peer's (with each round's own ratio, to show the spread).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tandem.bench.experiments.setup import http_client, workload
from tandem.bench.harness import (
    ServerSpec,
    ensure_model,
    free_port,
    running,
    session_cpu_s,
    tandem_spec,
    transformers_spec,
)
from tandem.bench.loadgen.load import LoadConfig
from tandem.bench.loadgen.metrics import RunSummary
from tandem.bench.loadgen.runner import BenchConfig, run_sweep
from tandem.bench.report import (
    machine_facts,
    machine_sentence,
    publish,
    render_table,
    write_json,
)
from tandem.engine.config import EngineConfig
from tandem.engine.host_cpus import available_cpus

logger = logging.getLogger(__name__)

SECTION_HEADING = "## Default topology vs `transformers serve` (make serve, one run)"
DEFAULT_LABEL = "tandem (make serve defaults)"
PEER_LABEL = "transformers serve --continuous-batching"
# The same server without continuous batching (`--plain-peer`, one request at a time):
# a second reference, and a check on the batching path's own cost.
PLAIN_PEER_LABEL = "transformers serve (no --continuous-batching)"
# Named variants: more `tandem serve` flags (and environment), measured like the default.
VARIANTS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "split": (("--thread-policy", "split"), {}),
    "one-thread": (("--threads", "1"), {}),
    "colocated-1": (("--colocated", "1"), {}),
    "colocated-2": (("--colocated", "2"), {}),
    "all-remote": (("--max-local-prefill-tokens", "0"), {}),
    # libgomp's own default spin count, set explicitly: every worker's OpenMP threads
    # spin before sleeping (`cluster.worker_env` makes only prefill workers passive).
    "spin-wait": ((), {"GOMP_SPINCOUNT": "300000"}),
    # Every worker's OpenMP threads sleep at once (prefill and decode alike).
    "passive-wait": ((), {"OMP_WAIT_POLICY": "PASSIVE"}),
    # Two decode workers (1P+2D), as the wait policy makes them (passive when their
    # threads oversubscribe the node), and with every worker spinning.
    "decode-2": (("--decode", "2"), {}),
    "decode-2-spin-wait": (("--decode", "2"), {"GOMP_SPINCOUNT": "300000"}),
}

# system label -> concurrency -> one run per round
Results = dict[str, dict[int, list["LevelRun"]]]


@dataclasses.dataclass(frozen=True)
class TopologyPlan:
    """What every system is asked, per round."""

    concurrencies: tuple[int, ...] = (1, 8)
    input_len: int = 128
    output_len: int = 64
    requests_per_slot: int = 4  # requests per level: max(min_requests, this x concurrency)
    min_requests: int = 8
    rounds: int = 3
    seed: int = 0

    def loads(self) -> list[LoadConfig]:
        return [
            LoadConfig(
                concurrency=c,
                num_requests=max(self.min_requests, self.requests_per_slot * c),
                seed=self.seed + i,
                timeout_s=900,
                progress=False,
            )
            for i, c in enumerate(self.concurrencies)
        ]


def serve_dtype(model_dir: str) -> str:
    """The dtype `make serve` (`tandem serve --dtype auto`) runs on this machine, which the
    peer is given too (EngineConfig's own default is float32, not auto)."""
    return EngineConfig(model=model_dir, device="cpu", dtype="auto").resolved_dtype


def peer_spec(model_dir: str, dtype: str) -> ServerSpec:
    """The peer on a free port, with the dtype and KV pool size of a Tandem worker."""
    blocks = EngineConfig(model=model_dir).num_blocks
    if blocks is None:
        raise RuntimeError(f"no KV pool size for {model_dir}")
    spec = transformers_spec(model_dir, free_port(), blocks)
    return dataclasses.replace(spec, label=PEER_LABEL, argv=(*spec.argv, "--dtype", dtype))


def plain_peer_spec(model_dir: str, dtype: str) -> ServerSpec:
    """`transformers serve` without continuous batching, same dtype, on a free port."""
    spec = peer_spec(model_dir, dtype)
    argv = [a for a in spec.argv if a != "--continuous-batching"]
    for flag in ("--cb-block-size", "--cb-num-blocks"):
        at = argv.index(flag)
        del argv[at : at + 2]
    return dataclasses.replace(spec, label=PLAIN_PEER_LABEL, argv=tuple(argv))


def tandem_specs(model_dir: str, variants: Sequence[str]) -> list[ServerSpec]:
    """`make serve` (no flags but the ports) and each named variant."""
    specs = [tandem_spec(DEFAULT_LABEL, model_dir, free_port(), free_port())]
    for name in variants:
        flags, env = VARIANTS[name]
        label = " ".join(["tandem", *flags, *(f"{k}={v}" for k, v in env.items())])
        spec = tandem_spec(label, model_dir, free_port(), free_port(), flags)
        specs.append(dataclasses.replace(spec, env={**spec.env, **env}))
    return specs


@dataclasses.dataclass(frozen=True)
class LevelRun:
    """One system at one level in one round."""

    summary: RunSummary
    # CPU seconds the server's whole process session (Ray daemons and workers included)
    # spent per output token: a cost that a busy machine distorts far less than tok/s.
    cpu_s_per_token: float


async def measure_rounds(specs: Sequence[ServerSpec], plan: TopologyPlan, log_dir: Path) -> Results:
    """Every system once per round (one at a time, order alternating), every level."""
    results: Results = {spec.label: {c: [] for c in plan.concurrencies} for spec in specs}
    for round_ in range(plan.rounds):
        order = list(specs) if round_ % 2 == 0 else list(reversed(specs))
        for spec in order:
            with running([spec], log_dir) as (server,):
                # Prompts differ per round (seed) but not per system within a round.
                work = workload("fixed", plan.input_len, plan.output_len, plan.seed + round_)
                for index, load in enumerate(plan.loads()):
                    warmup = 2 if index == 0 else 0
                    config = BenchConfig(http_client(spec), work, load, warmup_requests=warmup)
                    cpu_before_s = session_cpu_s(server.pid)
                    (result,) = await run_sweep(config, [load])
                    cpu_s = session_cpu_s(server.pid) - cpu_before_s
                    summary = result.summary
                    per_token = cpu_s / max(1, summary.total_output_tokens)
                    assert load.concurrency is not None
                    results[spec.label][load.concurrency].append(LevelRun(summary, per_token))
                    logger.info(
                        "round %d %s c=%d: %.1f out tok/s, %.1f CPU ms/token, %d failed",
                        round_, spec.label, load.concurrency, summary.output_throughput_tps,
                        per_token * 1e3, summary.num_failed,
                    )  # fmt: skip
    return results


def _median(runs: Sequence[LevelRun], field: str) -> float:
    if field == "cpu_s_per_token":
        return statistics.median(r.cpu_s_per_token for r in runs)
    values = [getattr(r.summary, field) for r in runs]
    return statistics.median(v if isinstance(v, float) else v.p50 for v in values)


def render_rows(results: Results, peer_label: str) -> list[list[str]]:
    """Per system and level: medians over rounds, their ratio to the peer's and, when it
    was measured, to the plain peer's."""
    peer = results.get(peer_label, {})
    plain = results.get(PLAIN_PEER_LABEL, {})
    rows = []
    for label, levels in results.items():
        for concurrency, runs in levels.items():
            tps = _median(runs, "output_throughput_tps")
            ttft, itl = _median(runs, "ttft_s"), _median(runs, "itl_s")
            failed = sum(r.summary.num_failed for r in runs)
            cpu_ms = _median(runs, "cpu_s_per_token") * 1e3
            peer_runs = peer.get(concurrency, [])
            if label == peer_label or not peer_runs:
                ratio, per_round = "-", "-"
            else:
                ratio = f"**{tps / _median(peer_runs, 'output_throughput_tps'):.2f}x**"
                per_round = ", ".join(
                    f"{mine.output_throughput_tps / theirs.output_throughput_tps:.2f}"
                    for mine, theirs in zip(
                        (r.summary for r in runs), (r.summary for r in peer_runs), strict=False
                    )
                    if theirs.output_throughput_tps > 0
                )
            plain_runs = plain.get(concurrency, [])
            plain_ratio = "-"
            if plain_runs and label not in (peer_label, PLAIN_PEER_LABEL):
                plain_ratio = f"{tps / _median(plain_runs, 'output_throughput_tps'):.2f}x"
            rows.append(
                [f"{label} · c={concurrency}", f"{tps:.1f}", ratio, per_round, plain_ratio,
                 f"{ttft * 1e3:.0f}", f"{itl * 1e3:.1f}", f"{cpu_ms:.0f}", str(failed)]
            )  # fmt: skip
    return rows


def render(
    results: Results, plan: TopologyPlan, command: str, facts: Mapping[str, Any], dtype: str
) -> str:
    threads = available_cpus()
    header = ["system · concurrency", "out tok/s", "÷ peer", "per round", "÷ plain peer",
              "TTFT p50 ms",
              "ITL p50 ms", "CPU ms/token", "failed"]  # fmt: skip
    return "\n".join(
        [
            f"Command: `{command}`",
            "",
            machine_sentence(dict(facts), os.getloadavg()),
            "",
            f"Model `{facts['model']}`, dtype {dtype} for both (Tandem's `auto` here); "
            f"torch threads: Tandem per its thread policy, the peer torch's default "
            f"({threads} on this machine). Closed loop at concurrency "
            f"{', '.join(map(str, plan.concurrencies))}; {plan.input_len} prompt words "
            f"(≈ tokens) → {plan.output_len} output tokens, greedy, OpenAI `/v1/completions` "
            f"over HTTP for every server; max({plan.min_requests}, {plan.requests_per_slot}·c) "
            f"requests per level; medians of {plan.rounds} rounds (one server at a time, "
            "order alternating).",
            "",
            render_table(header, render_rows(results, PEER_LABEL)),
        ]
    )


def main(args: argparse.Namespace) -> int:
    model_dir = str(ensure_model(Path(args.model), "small"))
    plan = TopologyPlan(
        concurrencies=tuple(args.concurrency), input_len=args.input_len,
        output_len=args.output_len, rounds=args.rounds,
        requests_per_slot=args.requests_per_slot,
    )  # fmt: skip
    if args.quick:
        plan = dataclasses.replace(plan, rounds=1, requests_per_slot=1, min_requests=2,
                                   output_len=min(plan.output_len, 16))  # fmt: skip
    dtype = serve_dtype(model_dir)
    specs = tandem_specs(model_dir, args.variants)
    if not args.no_peer:
        specs.append(peer_spec(model_dir, dtype))
        if args.plain_peer:
            specs.append(plain_peer_spec(model_dir, dtype))
    results_dir = Path(args.results_dir)
    facts = {**machine_facts(), "model": model_dir}
    results = asyncio.run(measure_rounds(specs, plan, results_dir / "logs"))
    path = results_dir / f"topology{'-quick' if args.quick else ''}.json"
    write_json(path, {"machine": facts, "plan": plan, "dtype": dtype, "results": {
        label: {str(c): runs for c, runs in levels.items()} for label, levels in results.items()
    }})  # fmt: skip
    text = render(results, plan, args.command, facts, dtype)
    out = "" if args.quick else args.out
    publish(out, SECTION_HEADING, [text])
    return 0
