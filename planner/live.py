"""The live planner: runs beside a serving router and recommends (or applies) the split.

Every `interval_s` it reads the traffic seen over the last `window_intervals` intervals
(`observe`, `live_inputs`): in a cluster every router's, summed by the pool controller
(a `TrafficSource`, `cluster.traffic`), else its own router's; takes the router's
online-corrected latency models (mean per role, averaged over the same window), and
searches every split of the budget in a separate process (`live_plan`); the current
split stays recommended unless another beats its predicted goodput by `min_gain`. It publishes
`tandem:planner_recommended_workers{role}`, `tandem:planner_predicted_goodput` and
`tandem:planner_observed_goodput` on the router's `/metrics` (and through the
`TrafficSource` on the pool controller's), and the recommendation
with its reason under `"planner"` in `/admin/pools` (so `tandem pools` shows it). In
`auto` it resizes the pools through the router's admin backend (the pool controller),
one worker at a time, behind the `ResizeGate` hysteresis.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Protocol

from tandem.engine.config import EngineConfig
from tandem.planner.hysteresis import ResizeGate, Split
from tandem.planner.live_config import PlannerConfig, PlannerMode
from tandem.planner.live_inputs import InputWindow, waiting_for_traffic
from tandem.planner.live_plan import LivePlanInput, LivePlanResult, compute_plan
from tandem.planner.observe import Counters, ObservedLoad, read_router_counters
from tandem.planner.planning_process import PlanningProcess
from tandem.planner.profile_format import EngineLimits
from tandem.planner.profile_model import LatencyLaws
from tandem.planner.simulator import SloTargets
from tandem.router.membership import Membership, PoolTargets, TargetsChanged, WorkerLifecycle
from tandem.router.policy import INTERACTIVE, GoodputPolicy, WorkerState
from tandem.router.server import Router
from tandem.worker.config import WorkerRole

logger = logging.getLogger(__name__)


class TrafficSource(Protocol):
    """Where a planner beside one of several routers reads the traffic of all of them,
    and publishes its gauges for all to see (`cluster.traffic.ClusterTraffic`)."""

    async def counters(self) -> Counters: ...

    async def publish(
        self,
        recommended: tuple[int, int] | None,
        predicted_rps: float | None,
        observed_rps: float,
        view: dict[str, Any],
    ) -> None: ...


def _mean(rows: Sequence[Sequence[float]]) -> tuple[float, ...]:
    return tuple(sum(col) / len(rows) for col in zip(*rows, strict=True))


def laws_from_router(workers: Sequence[WorkerState], transfer_s_per_token: float) -> LatencyLaws:
    """Mean online-corrected models: prefill from the prefill pool (else every worker),
    decode steps from the decode / colocated workers."""
    prefill = [w for w in workers if w.role is WorkerRole.PREFILL] or list(workers)
    decode = [w for w in workers if w.role is not WorkerRole.PREFILL] or list(workers)
    return LatencyLaws.from_router_models(
        _mean([w.prefill_model.coefficients for w in prefill]),
        _mean([w.decode_model.coefficients for w in decode]),
        transfer_s_per_token,
    )


def limits_of(engine: EngineConfig) -> EngineLimits:
    """The engine settings every worker of the cluster runs with."""
    return EngineLimits(
        block_size=engine.block_size,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        max_num_seqs=engine.max_num_seqs,
        num_blocks=engine.num_blocks,
        max_model_len=engine.max_model_len,
    )


def current_split(membership: Membership) -> tuple[Split | None, bool]:
    """The pools' targets as (prefill, decode), and whether they are met with no worker
    starting or draining."""
    targets = membership.targets
    if targets is None:
        return None, False
    live = [w for w in membership.workers if w.state is not WorkerLifecycle.DEAD]
    settled = all(w.state is WorkerLifecycle.SERVING for w in live)
    serving = {
        role: sum(w.role is role and w.state is WorkerLifecycle.SERVING for w in live)
        for role in (WorkerRole.PREFILL, WorkerRole.DECODE)
    }
    at_target = settled and (serving[WorkerRole.PREFILL], serving[WorkerRole.DECODE]) == (
        targets.prefill, targets.decode
    )  # fmt: skip
    return (targets.prefill, targets.decode), at_target


class LivePlanner:
    """Owns the planning task and the process its searches run in."""

    def __init__(
        self,
        config: PlannerConfig,
        router: Router,
        limits: EngineLimits,
        traffic: TrafficSource | None = None,
        max_per_role: int | None = None,
    ) -> None:
        if config.mode is PlannerMode.OFF:
            raise ValueError("the planner is off")
        self.config = config
        self.router = router
        self.limits = limits
        # Every router's traffic (a cluster's); None: this router's only.
        self.traffic = traffic
        # The most workers the pools take of one role: no split beyond it is recommended.
        self.max_per_role = max_per_role
        self.gate = ResizeGate(config.change_interval_s, config.confirmations)
        self.budget = config.max_workers
        # No --max-workers: the budget is the pools' size, and follows an operator's scale
        # (the planner's own moves keep the total). Else it is a cap the pools come back to.
        self.budget_follows_pools = config.max_workers is None
        self.last: LivePlanResult | None = None
        self.last_load: ObservedLoad | None = None
        self.last_laws: LatencyLaws | None = None
        self.last_action = "none yet"
        self.num_changes = 0
        self.num_plans = 0
        self._inputs: InputWindow | None = None
        self._task: asyncio.Task | None = None
        self._process = PlanningProcess()

    # ----- life ------------------------------------------------------------------------

    async def start(self) -> None:
        self._process.start()
        if self.budget is None:
            split, _ = current_split(await self._pools())
            self.budget = sum(split) if split else len(self._workers())
        await self._reset_counters()
        self.router.planner_view = self.view
        self._task = asyncio.create_task(self._run_forever(), name="live-planner")
        logger.info("planner (%s): every %g s, budget %d workers",
                    self.config.mode.value, self.config.interval_s, self.budget)  # fmt: skip

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._process.stop()

    async def _run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # one failed plan must not end planning
                logger.exception("planner: this interval's plan failed")

    # ----- one interval ----------------------------------------------------------------

    async def run_once(self) -> None:
        """Observe the last interval, plan, (auto) maybe resize; publish the gauges once,
        whatever the interval ended with."""
        now = time.monotonic()
        assert self._inputs is not None
        load = self._inputs.observe(now, await self._read_counters())
        self.last_load = load
        self.router.metrics.planner.observe(load.goodput_rps)
        try:
            await self._plan_and_act(load, now)
        finally:
            await self._publish()

    async def _plan_and_act(self, load: ObservedLoad, now: float) -> None:
        if self.budget is not None and self.budget < 2:
            self.last_action = f"a budget of {self.budget} worker cannot split (--max-workers >= 2)"
            return
        waiting = waiting_for_traffic(load, self.config.min_requests)
        if waiting is not None:
            self.last_action = waiting
            gauges = self.router.metrics.planner
            if gauges.recommended is not None:
                # Its prediction is for the observed load, which is (next to) none now;
                # the last plan's figure would stand for hours after the traffic went.
                gauges.recommend(gauges.recommended, 0.0)
            return
        membership = await self._pools()
        split, at_target = current_split(membership)
        if self.budget_follows_pools and split is not None and sum(split) != self.budget:
            logger.info("planner: the pools were scaled to %d workers; planning for that many",
                        sum(split))  # fmt: skip
            self.budget = sum(split)
        result = await self._plan(load, split)
        self.last = result
        self.num_plans += 1
        self.router.metrics.planner.recommend(result.recommended, result.predicted_goodput_rps)
        logger.info("planner: %s", result.reason)
        if self.config.mode is not PlannerMode.AUTO:
            self.last_action = "observe mode: recommendation only"
            return
        if split is None:
            self.last_action = "colocated pools: resize by hand"
            return
        # The plan took seconds: one from a split the pools left meanwhile (an operator's
        # scale) neither counts toward the gate's confirmations nor resizes; the scale
        # itself is a compare-and-set for a change landing after this read.
        if current_split(await self._pools())[0] != split:
            self.last_action = "the pools were resized while planning; the next plan decides"
            return
        target, why = self.gate.decide(now, split, result.recommended, at_target)
        self.last_action = why
        if target is not None and await self._scale(target, split):
            self.gate.changed(now, target)

    def _policy(self) -> GoodputPolicy:
        runtime = self.router.policy_runtime
        if runtime is None or runtime.policy is None:
            raise RuntimeError("the router is not serving")
        return runtime.policy

    async def _plan(self, load: ObservedLoad, split: Split | None) -> LivePlanResult:
        runtime = self.router.policy_runtime
        assert runtime is not None and self.budget is not None
        policy = self._policy()
        assert self._inputs is not None
        latest = laws_from_router(self._workers(), policy.selector.config.kv_transfer_s_per_token)
        laws = self._inputs.laws(latest)
        self.last_laws = laws
        slo = runtime.slo.resolve()
        targets = SloTargets(slo.ttft_s or INTERACTIVE.slo.ttft_s or 1.0,
                             slo.itl_s or INTERACTIVE.slo.itl_s or 0.1)  # fmt: skip
        given = LivePlanInput(
            laws, self.limits, self.budget, targets, load, split,
            policy.selector.config.max_local_prefill_tokens, self.config.num_sim_requests,
            min_gain=self.config.min_gain, max_per_role=self.max_per_role,
        )  # fmt: skip
        return await self._process.run(compute_plan, given, max(60.0, 2 * self.config.interval_s))

    async def _scale(self, target: Split, planned_from: Split) -> bool:
        """Resize the pools to `target`, only while they are still at the split the plan
        began with (the plan took seconds: an operator's scale meanwhile is not undone by
        a step from the old split, targets being set whole); whether the owner took it."""
        backend = self.router.admin_backend
        assert backend is not None
        try:
            await backend.scale(
                PoolTargets(prefill=target[0], decode=target[1]),
                if_targets=PoolTargets(prefill=planned_from[0], decode=planned_from[1]),
            )
        except TargetsChanged:
            self.last_action = "the pools were resized while planning; the next plan decides"
            logger.info("planner: %s", self.last_action)
            return False
        except (ValueError, RuntimeError) as exc:
            self.last_action = f"scale to {target[0]}P+{target[1]}D refused: {exc}"
            logger.warning("planner: %s", self.last_action)
            return False
        self.num_changes += 1
        self.last_action = f"scaled to {target[0]}P+{target[1]}D"
        logger.info("planner: %s", self.last_action)
        return True

    # ----- reading the router ----------------------------------------------------------

    def _workers(self) -> list[WorkerState]:
        return [w for w in self._policy().workers.values() if w.available]

    async def _pools(self) -> Membership:
        backend = self.router.admin_backend
        if backend is None:
            raise RuntimeError("the live planner needs a router with a pool controller")
        return await backend.get_pools()

    async def _read_counters(self) -> Counters:
        if self.traffic is not None:
            return await self.traffic.counters()
        return read_router_counters(self.router)

    async def _reset_counters(self) -> None:
        counters = await self._read_counters()
        self._inputs = InputWindow(self.config.window_intervals, time.monotonic(), counters)

    async def _publish(self) -> None:
        """This router's planner gauges and view, also where every router's traffic comes
        from (every router shows the view)."""
        if self.traffic is None:
            return
        gauges = self.router.metrics.planner
        try:
            await self.traffic.publish(
                gauges.recommended, gauges.predicted_rps, gauges.observed_rps or 0.0, self.view()
            )
        except Exception as exc:  # the gauges lag; planning goes on
            logger.warning("planner: publishing its gauges failed: %s", exc)

    def view(self) -> dict[str, Any]:
        """The `"planner"` key of `/admin/pools`."""
        body: dict[str, Any] = {
            "mode": self.config.mode.value,
            "interval_s": self.config.interval_s,
            "budget": self.budget,
            "recommended": None,
            "reason": "no plan yet",
            "last_action": self.last_action,
            "plans": self.num_plans,
            "changes": self.num_changes,
        }
        if self.last is not None:
            body["recommended"] = {"prefill": self.last.recommended[0],
                                   "decode": self.last.recommended[1]}  # fmt: skip
            body["reason"] = self.last.reason
            body["predicted_goodput_rps"] = round(self.last.predicted_goodput_rps, 4)
            body["goodput_rps"] = {f"{p}P+{d}D": round(g, 4)
                                   for (p, d), g in sorted(self.last.goodput.items())}  # fmt: skip
        if self.last_laws is not None:
            body["latency_models"] = {
                name: float(f"{value:.4g}") for name, value in asdict(self.last_laws).items()
            }
        if self.last_load is not None:
            load = self.last_load
            body["observed"] = {
                "arrival_rate_rps": round(load.arrival_rate_rps, 4),
                "mean_prompt_tokens": round(load.mean_prompt_tokens, 1),
                "mean_output_tokens": round(load.mean_output_tokens, 1),
                "prefix_hit_share": round(load.prefix_hit_share, 3),
                "goodput_rps": round(load.goodput_rps, 4),
            }
        return body
