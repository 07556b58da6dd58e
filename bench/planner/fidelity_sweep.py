"""One fidelity cell: a capped rate sweep that brackets the measured goodput, and the
simulator replaying exactly the requests each swept rate sent.

Each swept rate is one open-loop Poisson run of fresh requests (a seed of its own, so
no rate finds an earlier rate's prompts in the prefix cache): `rate · duration_s`
arrivals (at least `min_requests`, at most `max_requests`), and never past 1.5 times
the time they should take; requests still in flight `grace_s` after the last arrival
are cancelled and count as outside the SLO, never dropped. The simulator replays the
same requests at the same send times and cuts its run at the same moment (`until_s`).

Rates start at the planner's goodput and move by `step` until one run meets the 90%
attainment target and a higher one misses; then one more between the two closest
(geometric mean) while they are more than `close_enough` apart, within `max_runs`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from prometheus_client.parser import text_string_to_metric_families

from tandem.bench.harness import process_cpu_s
from tandem.bench.loadgen.clients import Client, ServerInfo
from tandem.bench.loadgen.load import LoadConfig, poisson_schedule, run_load
from tandem.bench.loadgen.metrics import RunSummary, SloTargets
from tandem.bench.loadgen.runner import WorkloadConfig, build_workload, summarize_run
from tandem.planner.simulator import ClusterSimulation, SimReport
from tandem.planner.workload import PlanRequest, PlanWorkload

logger = logging.getLogger(__name__)

TARGET_ATTAINMENT = 0.9
_DRAIN_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RunPlan:
    """What one swept rate sends, known before it runs (the load generator draws the
    same schedule from the same rate, seed, count and window)."""

    num_requests: int
    # Arrivals stop here (s from the start) even if fewer than `num_requests` came.
    window_s: float
    # Send offsets (s from the start).
    schedule: list[float]
    # In-flight requests are cancelled here (s from the start): the last arrival + grace.
    cut_s: float


@dataclass(frozen=True)
class SweepSettings:
    # Seconds of arrivals per swept rate (more at low rates: `min_requests`).
    duration_s: float = 25.0
    # Requests still in flight this long after the last arrival are cut (SLO misses).
    grace_s: float = 20.0
    min_requests: int = 16
    max_requests: int | None = None
    max_runs: int = 4
    step: float = 1.5
    close_enough: float = 1.25
    # The first rate is the planner's goodput, but at least this.
    min_rate_rps: float = 0.05

    def run_plan(self, rate_rps: float, seed: int) -> RunPlan:
        count = max(self.min_requests, math.ceil(rate_rps * self.duration_s))
        if self.max_requests is not None:
            count = min(count, self.max_requests)
        window_s = 1.5 * count / rate_rps
        schedule = poisson_schedule(rate_rps, seed, count, window_s)
        while not schedule:  # the first gap past the window (rare with a few requests)
            window_s *= 2
            schedule = poisson_schedule(rate_rps, seed, count, window_s)
        return RunPlan(count, window_s, schedule, schedule[-1] + self.grace_s)


@dataclass(frozen=True)
class RatePoint:
    """One swept rate: what was measured and what the simulator said of the same requests."""

    rate_rps: float
    seed: int
    num_sent: int
    measured: RunSummary
    # The replay with the workers sharing the node's cores, and without (evidence).
    sim: SimReport
    sim_unshared: SimReport
    # Router placements during the run (`tandem:disagg_decisions_total` increments).
    decisions: dict[str, float]
    # Cores the router (the `tandem serve` process) and the load generator (this one)
    # kept busy on average during the run: CPU the simulator does not model.
    router_cores: float = math.nan
    client_cores: float = math.nan

    @property
    def met(self) -> bool:
        return self.measured.slo_attainment >= TARGET_ATTAINMENT

    @property
    def num_cut(self) -> int:
        """Requests cancelled at the cap (in flight `grace_s` after arrivals stopped)."""
        return self.measured.errors.get("cancelled", 0)


def next_rate(points: Sequence[RatePoint], settings: SweepSettings) -> float | None:
    """The next rate to try, or None once the goodput is bracketed closely enough."""
    met = [p.rate_rps for p in points if p.met]
    missed = [p.rate_rps for p in points if not p.met]
    if not met:
        return min(missed) / settings.step
    if not missed:
        return max(met) * settings.step
    low = max(met)
    high = min((r for r in missed if r > low), default=None)
    if high is None or high / low <= settings.close_enough:
        return None  # bracketed (or a miss below a met rate: noise the sweep cannot fix)
    return math.sqrt(low * high)


@dataclass
class Cell:
    """A workload against one running layout (the client started, the server known)."""

    client: Client
    server: ServerInfo
    metrics_url: str
    config: WorkloadConfig
    slo: SloTargets
    # A fresh simulation of this layout: with the workers sharing cores (True) or not.
    simulation: Callable[[bool], ClusterSimulation]
    settings: SweepSettings
    seed_base: int
    # The `tandem serve` process (its router's CPU time is recorded); None: not recorded.
    router_pid: int | None = None

    async def sweep(self, start_rps: float, allowance_s: float = math.inf) -> list[RatePoint]:
        """Runs from `start_rps` until the goodput is bracketed; a refining run (between a
        met and a missed rate) only while it fits in `allowance_s` from the start."""
        points: list[RatePoint] = []
        rate: float | None = start_rps
        started = time.perf_counter()
        while rate is not None and len(points) < self.settings.max_runs:
            points.append(await self.run_rate(round(rate, 4), self.seed_base + len(points)))
            rate = next_rate(points, self.settings)
            bracketed = any(p.met for p in points) and not all(p.met for p in points)
            if rate is not None and bracketed:
                plan = self.settings.run_plan(rate, self.seed_base + len(points))
                if time.perf_counter() - started + plan.cut_s > allowance_s:
                    logger.info("%s: no refining run (the time budget)", self.config.kind)
                    break
        return points

    def replay(self, rate_rps: float, seed: int) -> tuple[PlanWorkload, float]:
        """The requests a run at `rate_rps` sends (same specs, same send offsets), and
        the cut time measured from the first arrival."""
        workload = build_workload(replace(self.config, seed=seed), self.server)
        plan = self.settings.run_plan(rate_rps, seed)
        specs = [workload.request(i) for i in range(len(plan.schedule))]
        requests = tuple(PlanRequest(s.prompt_len, s.max_tokens) for s in specs)
        first = plan.schedule[0]
        arrivals = tuple(t - first for t in plan.schedule)
        return PlanWorkload(self.config.kind, requests, arrivals), plan.cut_s - first

    def simulate(self, rate_rps: float, seed: int, shared: bool) -> SimReport:
        workload, until_s = self.replay(rate_rps, seed)
        native = workload.native_rate_rps
        rate = native if math.isfinite(native) else rate_rps
        return self.simulation(shared).run(workload, rate, until_s=until_s)

    async def run_rate(self, rate_rps: float, seed: int) -> RatePoint:
        workload = build_workload(replace(self.config, seed=seed), self.server)
        plan = self.settings.run_plan(rate_rps, seed)
        load = LoadConfig(rate_rps=rate_rps, num_requests=plan.num_requests,
                          duration_s=plan.window_s, timeout_s=plan.cut_s, seed=seed,
                          progress=False)  # fmt: skip
        before = await asyncio.to_thread(scrape, self.metrics_url)
        cpu_before = self._cpu_s()
        started = time.perf_counter()
        result = await run_load(self.client, workload, load)
        wall_s = time.perf_counter() - started
        router_cores, client_cores = (
            (after - before) / wall_s
            for after, before in zip(self._cpu_s(), cpu_before, strict=True)
        )
        summary, _ = summarize_run(result, self.slo)
        await asyncio.to_thread(wait_idle, self.metrics_url)
        after = await asyncio.to_thread(scrape, self.metrics_url)
        decisions = {k.removeprefix("decision="): after[k] - before.get(k, 0.0)
                     for k in after if k.startswith("decision=")}  # fmt: skip
        point = RatePoint(rate_rps, seed, summary.num_requests, summary,
                          self.simulate(rate_rps, seed, True),
                          self.simulate(rate_rps, seed, False), decisions, router_cores,
                          client_cores)  # fmt: skip
        logger.info(
            "%s at %.3g req/s: %d sent, attainment %.2f (sim %.2f), %d cut, %.0f s",
            self.config.kind, rate_rps, point.num_sent, summary.slo_attainment,
            point.sim.attainment, point.num_cut, time.perf_counter() - started,
        )  # fmt: skip
        return point

    def _cpu_s(self) -> tuple[float, float]:
        """CPU seconds so far of the router process and of this one (NaN: unreadable)."""
        router = process_cpu_s(self.router_pid) if self.router_pid is not None else None
        own = process_cpu_s(os.getpid())
        return (math.nan if router is None else router, math.nan if own is None else own)


def scrape(metrics_url: str) -> dict[str, float]:
    """The router's requests in flight ("running") and placements ("decision=LABEL")."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {"running": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tandem:num_requests_running":
                out["running"] += sample.value
            elif sample.name == "tandem:disagg_decisions_total":
                key = f"decision={sample.labels.get('decision', '')}"
                out[key] = out.get(key, 0.0) + sample.value
    return out


def wait_idle(metrics_url: str, timeout_s: float = _DRAIN_TIMEOUT_S) -> None:
    """Wait until the router has no request in flight (cancelled ones wind down), so the
    next rate starts on an idle cluster."""
    deadline = time.monotonic() + timeout_s
    while scrape(metrics_url)["running"] > 0:
        if time.monotonic() > deadline:
            logger.warning("router still busy %.0f s after a run; going on", timeout_s)
            return
        time.sleep(0.5)
