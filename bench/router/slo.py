"""SLO admission under overload: shedding vs admitting everything, on a real cluster."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import re
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.bench.harness import ServerSpec, cpu_pair_spec, ensure_model, running
from tandem.bench.loadgen.load import LoadConfig, grpc_load
from tandem.bench.loadgen.metrics import Distribution, RunSummary, SloTargets, e2e_s, tpot_s, ttft_s
from tandem.bench.loadgen.metrics import summarize as loadgen_summarize
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

logger = logging.getLogger(__name__)

SECTION_HEADING = "## SLO admission under overload"
FULL_COMMAND = ".venv/bin/tandem-bench slo"
SHED_STATUS = "RESOURCE_EXHAUSTED"
NUM_WARMUP = 12
# The router always has an ITL target; this one never binds (the SLO here is TTFT).
ITL_OFF_S = 60.0
MIN_ATTAINMENT = 0.9
# Prompt seeds: every phase gets its own prompts (no cross-phase prefix-cache hits).
_WARMUP_SEED, _UNLOADED_SEED, _PROBE_SEED, _TRACE_SEED = 1, 2, 100, 10_000
# `tandem serve`'s default `--max-local-prefill-tokens` (conditional disaggregation on).
DEFAULT_LOCAL_PREFILL = 512
# name{labels} value, one Prometheus sample per line
ROUTER_COUNTERS = ("tandem:requests_rejected_total", "tandem:disagg_decisions_total")
_SAMPLE = re.compile(r"^(?P<name>[^{\s]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")


def is_shed(trace: RequestTrace) -> bool:
    """Turned away by admission: `RESOURCE_EXHAUSTED` before any token."""
    return trace.error.startswith(SHED_STATUS) and not trace.token_times_s


@dataclass(frozen=True)
class AdmissionSummary:
    """One trace under admission control: what was shed, and the summary of the admitted
    requests (its SLO attainment is attainment *of admitted*; failures count as misses)."""

    num_offered: int
    num_shed: int
    shed_latency: Distribution  # how long a shed request waited for its rejection
    admitted: RunSummary

    @property
    def offered_rate(self) -> float:
        return self.num_offered / self.admitted.duration_s

    @property
    def admitted_fraction(self) -> float:
        return self.admitted.num_requests / self.num_offered if self.num_offered else math.nan


def summarize(
    traces: Sequence[RequestTrace], duration_s: float, ttft_target_s: float
) -> AdmissionSummary:
    admitted = [t for t in traces if not is_shed(t)]
    return AdmissionSummary(
        num_offered=len(traces),
        num_shed=len(traces) - len(admitted),
        shed_latency=Distribution.of([e2e_s(t) for t in traces if is_shed(t)]),
        admitted=loadgen_summarize(admitted, duration_s, SloTargets(ttft_s=ttft_target_s)),
    )


@dataclass(frozen=True)
class Probe:
    """One capacity probe: a Poisson rate with no admission control, and its result."""

    rate_per_s: float
    summary: AdmissionSummary

    def passed(self, min_attainment: float) -> bool:
        s = self.summary.admitted
        return s.num_failed == 0 and s.slo_attainment >= min_attainment


def capacity_of(probes: Sequence[Probe], min_attainment: float) -> float | None:
    """The highest rate that passed below the first that did not; None if none passed."""
    best = None
    for probe in sorted(probes, key=lambda p: p.rate_per_s):
        if not probe.passed(min_attainment):
            break
        best = probe.rate_per_s
    return best


def parse_samples(text: str, prefixes: Sequence[str]) -> dict[str, float]:
    """'name{labels}' -> value of the Prometheus samples named `prefixes*`, without the
    `model_name` label (one model per router)."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or not match["name"].startswith(tuple(prefixes)):
            continue
        labels = match["labels"] or ""
        kept = ",".join(p for p in labels.split(",") if p and not p.startswith("model_name="))
        samples[f"{match['name']}{{{kept}}}" if kept else match["name"]] = float(match["value"])
    return samples


@dataclass(frozen=True)
class RunSetup:
    """One overload run: the router's admission policy and conditional disaggregation."""

    label: str
    policy: str
    local_prefill_tokens: int = 0  # 0: every prompt goes to the prefill worker


@dataclass(frozen=True)
class Calibration:
    num_prompt_tokens: float  # mean, by the router's tokenizer
    unloaded_ttft: Distribution
    unloaded_e2e: Distribution
    unloaded_itl: Distribution
    ttft_target_s: float
    probes: tuple[Probe, ...]
    capacity_per_s: float | None  # None when even the first probe missed the target


@dataclass(frozen=True)
class PolicyRun:
    setup: RunSetup
    summary: AdmissionSummary
    router_counters: dict[str, float]  # rejections, prefill placement decisions
    load_average_start: tuple[float, float, float]
    load_average_end: tuple[float, float, float]


def _spec(args: argparse.Namespace, setup: RunSetup, target_s: float) -> ServerSpec:
    flags: tuple[str, ...] = ("--admission", setup.policy, "--ttft-slo", f"{target_s:g}")
    flags += ("--itl-slo", f"{ITL_OFF_S:g}")
    flags += ("--max-local-prefill-tokens", str(setup.local_prefill_tokens))
    return cpu_pair_spec(f"slo-{setup.label}", args.model, flags)


def _load(spec: ServerSpec, prompts: TextPrompts, config: LoadConfig) -> list[RequestTrace]:
    return asyncio.run(grpc_load(spec.grpc_target or "", prompts, config)).traces


def _sequential(spec: ServerSpec, seed: int, count: int, max_tokens: int) -> list[RequestTrace]:
    """One request at a time: warm-up (code paths, latency models) or the unloaded baseline."""
    config = LoadConfig(concurrency=1, num_requests=count, progress=False)
    traces = _load(spec, TextPrompts(seed, max_tokens), config)
    failed = [t.error for t in traces if t.error]
    if failed:
        raise RuntimeError(f"sequential requests failed: {failed}")
    return sorted(traces, key=lambda t: t.send_s)


def _trace(spec: ServerSpec, args: argparse.Namespace, rate: float, duration_s: float, seed: int,
           prompt_seed: int) -> list[RequestTrace]:  # fmt: skip
    """An open-loop Poisson trace at `rate` for `duration_s` seconds of arrivals."""
    config = LoadConfig(
        rate_rps=rate, duration_s=duration_s, timeout_s=duration_s + 3600, seed=seed,
        progress=False,
    )  # fmt: skip
    return _load(spec, TextPrompts(prompt_seed, args.max_tokens), config)


def calibrate(args: argparse.Namespace) -> Calibration:
    # Admission `none`: the target only labels the router's metrics here.
    spec = _spec(args, RunSetup("calibration", "none"), ITL_OFF_S)
    with running([spec], args.json.parent / "logs"):
        _sequential(spec, _WARMUP_SEED, NUM_WARMUP, args.max_tokens)
        timings = _sequential(spec, _UNLOADED_SEED, 16, args.max_tokens)
        ttft = Distribution.of([x for x in map(ttft_s, timings) if x is not None])
        itl = Distribution.of([x for x in map(tpot_s, timings) if x is not None])
        # Rounded up to 10 ms so the target reads as a round number.
        target = math.ceil(args.ttft_multiple * ttft.p50 * 100) / 100
        logger.info("unloaded TTFT p50 %s; target %s", format_ms(ttft.p50), format_ms(target))
        # Start where the prefill worker would be ~30% busy with unloaded-TTFT requests.
        rate = 0.3 / ttft.p50
        probes: list[Probe] = []
        for i in range(args.max_probes):
            duration = max(args.probe_duration, args.probe_requests / rate)
            traces = _trace(spec, args, rate, duration, _PROBE_SEED + i, _PROBE_SEED + i)
            probes.append(Probe(rate, summarize(traces, duration, target)))
            attainment = probes[-1].summary.admitted.slo_attainment
            logger.info("probe %.2f req/s: attainment %.0f%%", rate, attainment * 100)
            if not probes[-1].passed(MIN_ATTAINMENT):
                break
            rate *= args.probe_step
    return Calibration(
        num_prompt_tokens=sum(t.prompt_len for t in timings) / len(timings),
        unloaded_ttft=ttft,
        unloaded_e2e=Distribution.of([e2e_s(t) for t in timings]),
        unloaded_itl=itl,
        ttft_target_s=target,
        probes=tuple(probes),
        capacity_per_s=capacity_of(probes, MIN_ATTAINMENT),
    )


def run_policy(
    args: argparse.Namespace, setup: RunSetup, target_s: float, rate: float
) -> PolicyRun:
    spec = _spec(args, setup, target_s)
    with running([spec], args.json.parent / "logs"):
        _sequential(spec, _WARMUP_SEED, NUM_WARMUP, args.max_tokens)
        load_start = os.getloadavg()
        traces = _trace(spec, args, rate, args.duration, args.seed, _TRACE_SEED + args.seed)
        load_end = os.getloadavg()
        with urllib.request.urlopen(f"{spec.http_url}/metrics", timeout=10) as reply:
            counters = parse_samples(reply.read().decode(), ROUTER_COUNTERS)
    summary = summarize(traces, args.duration, target_s)
    a = summary.admitted
    logger.info(
        "%s: admitted %.0f%%, attainment %.0f%%, goodput %.2f req/s", setup.label,
        summary.admitted_fraction * 100, a.slo_attainment * 100, a.goodput_rps,
    )  # fmt: skip
    return PolicyRun(setup, summary, counters, load_start, load_end)


def _pct(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.0%}"


def _probe_row(p: Probe) -> list[str]:
    a = p.summary.admitted
    return [
        f"{p.rate_per_s:.2f}", f"{a.duration_s:.0f}", str(p.summary.num_offered),
        _pct(a.slo_attainment), format_ms(a.ttft_s.p50), format_ms(a.ttft_s.p99),
        "yes" if p.passed(MIN_ATTAINMENT) else "no",
    ]  # fmt: skip


def render_probes(calibration: Calibration) -> str:
    rows = [_probe_row(p) for p in calibration.probes]
    header = "rate (req/s)|seconds|requests|TTFT ≤ target|p50 TTFT|p99 TTFT|passed"
    return render_table(header.split("|"), rows)


def _run_row(run: PolicyRun) -> list[str]:
    s, a = run.summary, run.summary.admitted
    return [
        run.setup.label, f"`{run.setup.policy}`", str(run.setup.local_prefill_tokens),
        f"{s.offered_rate:.2f} ({s.num_offered})", _pct(s.admitted_fraction), str(s.num_shed),
        str(a.num_failed), f"**{_pct(a.slo_attainment)}**", f"{a.goodput_rps:.2f}",
        format_ms(a.ttft_s.p50), format_ms(a.ttft_s.p99), format_ms(a.tpot_s.p50),
    ]  # fmt: skip


def render_runs(runs: Sequence[PolicyRun]) -> str:
    rows = [_run_row(run) for run in runs]
    header = (
        "run|admission|local prefill ≤|offered req/s (requests)|admitted|shed (429)|failed|"
        "attainment of admitted|goodput req/s|p50 TTFT|p99 TTFT|p50 mean ITL"
    )
    return render_table(header.split("|"), rows)


def _counters(run: PolicyRun) -> str:
    shown = ", ".join(
        f"`{k.removeprefix('tandem:')}` {v:g}" for k, v in sorted(run.router_counters.items())
    )
    return f"{run.setup.label}: {shown or 'none'}"


def render_section(report: dict[str, Any]) -> list[str]:
    """The generated blocks: the run and its machine; calibration, probes and the runs."""
    c: Calibration = report["calibration"]
    runs: Sequence[PolicyRun] = report["runs"]
    capacity = "none" if c.capacity_per_s is None else f"{c.capacity_per_s:.2f} req/s"
    ratio = c.ttft_target_s / c.unloaded_ttft.p50
    offered = report["offered_rate_per_s"]
    loads = [
        f"{r.setup.label} {r.load_average_start[0]:.2f} → {r.load_average_end[0]:.2f}" for r in runs
    ]
    machine = machine_sentence(report["machine"], report["load_average_end"])
    results = [
        f"- *Unloaded* (sequential, after warm-up): TTFT p50 {format_ms(c.unloaded_ttft.p50)}, "
        f"p99 {format_ms(c.unloaded_ttft.p99)}; end-to-end p50 "
        f"{format_ms(c.unloaded_e2e.p50)}; mean ITL p50 {format_ms(c.unloaded_itl.p50)}.",
        f"- *TTFT target*: {format_ms(c.ttft_target_s, 0)} = unloaded p50 × {ratio:.1f} "
        "(`--ttft-multiple`, rounded up to 10 ms).",
        f"- *Capacity* (mean prompt {c.num_prompt_tokens:.0f} tokens, admission `none`, "
        "`--max-local-prefill-tokens 0`): the last rising Poisson rate at which "
        f"{MIN_ATTAINMENT:.0%} of requests met the target: **{capacity}**.",
        "",
        render_probes(c),
        "",
        f"**Overload.** One Poisson trace at {offered:.2f} req/s (the capacity × "
        f"{offered / (c.capacity_per_s or math.nan):.1f}; seed {report['seed']}) for "
        f"{report['duration_s']:g} s, replayed on a fresh cluster per run after {NUM_WARMUP} "
        f"sequential warm-up requests; `max_tokens={report['max_tokens']}`.",
        "",
        render_runs(runs),
        "",
        "Router counters after each run: " + "; ".join(_counters(r) for r in runs) + ".",
        "Load average (1 min) at the start → end of each trace: " + "; ".join(loads) + ".",
    ]
    run = run_block(FULL_COMMAND, report["command"], report["wall_s"], machine)
    return [run, "\n".join(results)]


def main(args: argparse.Namespace) -> int:
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
    setups = [
        RunSetup(f"{policy}{label}", policy, local)
        for label, local in (("", 0), (", default local prefill", DEFAULT_LOCAL_PREFILL))
        for policy in ("shed", "none")
    ]
    runs = [run_policy(args, s, calibration.ttft_target_s, offered) for s in setups]
    report = {
        "command": args.command, "wall_s": time.monotonic() - started, "machine": facts,
        "load_average_end": os.getloadavg(), "model": args.preset, "max_tokens": args.max_tokens,
        "calibration": calibration, "offered_rate_per_s": offered, "duration_s": args.duration,
        "seed": args.seed, "runs": runs,
    }  # fmt: skip
    write_json(args.json, report)
    publish(args.out, SECTION_HEADING, render_section(report), write=not args.quick)
    return 0
