"""The pool controller: the one owner of pool membership, as a named Ray actor.

It keeps each role at its target size: starts every worker as a `WorkerActor` that
asks for the role's Ray resource (so an autoscaler can add a node for a pending
worker), probes each worker every `health_interval_s`, replaces a dead one, and on a
scale-down drains a worker (routers stop placing on it, its requests finish, its
blocks come back) before stopping it. A drain asked for (`drain()`, or `drain_node()`
for every worker on a Ray node about to go) replaces the worker: where the cluster has
room for one more, the worker serves on until its replacement does (make before break:
a role's only worker leaves no gap), at most `replace_wait_s`; else it drains at once.
Routers follow the changes through `watch()` (see `cluster.membership_watcher`); admin
calls arrive through `scale()` / `drain()` (see `cluster.admin_backend`) and `tandem
drain`. Bookkeeping and decisions live in `PoolState`.

Worker lifecycle: starting -> serving (-> being replaced) -> draining -> (stopped,
gone); any of them -> dead (process exited, node lost, probes failed) -> listed for
`dead_retention_s`, then gone; a dead starting or serving worker is replaced at once,
unless its role's workers keep dying young (then after a growing pause,
`cluster.restart_backoff`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from typing import Any

import ray
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from tandem.cluster.config import ClusterConfig, role_resource
from tandem.cluster.pool_state import PoolState, WorkerLoad, WorkerRecord
from tandem.cluster.ray_nodes import check_drainable, keep_new_actors_off
from tandem.cluster.restart_backoff import BackoffPolicy
from tandem.cluster.threads import AwayThreads
from tandem.cluster.traffic_totals import TrafficTotals
from tandem.cluster.worker_actor import RemoteWorkerActor, WorkerPlacement, node_host
from tandem.cluster.worker_env import NodePools, WorkerEnvRule, node_capacity
from tandem.planner.observe import Counters
from tandem.router.membership import (
    Membership,
    PoolTargets,
    TargetsChanged,
    WorkerInfo,
    WorkerLifecycle,
)
from tandem.router.pool_gauges import PlannerGauges, PoolGauges
from tandem.worker.config import WorkerConfig, WorkerRole

logger = logging.getLogger(__name__)

CONTROLLER_NAME = "tandem-pool-controller"
CONTROLLER_NAMESPACE = "tandem"
# How long a call to the controller may take beyond the wait it asks for: its callers
# bound their awaits by it, so a stuck controller or a lost reply fails them with a
# TimeoutError instead of hanging them.
CONTROLLER_REPLY_S = 30.0


class PoolController:
    """Async actor; its event loop runs the reconcile loop and answers calls in between.

    Calls interleave only at awaits, and every change to the state happens between
    two awaits, so a scale call is applied whole or not at all (the last one wins).
    """

    def __init__(
        self,
        config: ClusterConfig,
        num_threads: int,
        env_rule: WorkerEnvRule | None = None,
    ) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        self.config = config
        # torch threads per worker, fixed at cluster start.
        self.num_threads = num_threads
        # Decides what each worker process's environment gets (`cluster.worker_env`), from
        # the pools at its start: the larger of the start's pools and the targets then.
        # None: nothing added.
        self.env_rule = env_rule
        self.start_pools = NodePools.at_start(config)
        pools = config.pools
        targets: dict[WorkerRole, int] = {}
        for role in pools.roles:
            targets[role] = targets.get(role, 0) + 1
        backoff = BackoffPolicy(
            pools.restart_backoff_s, pools.restart_backoff_max_s, pools.restart_stable_s
        )
        self.state = PoolState(targets, pools.max_workers_per_role, backoff)
        # The pool gauges routers re-export, served on the controller's own /metrics.
        self.metrics_registry = CollectorRegistry()
        self.gauges = PoolGauges(self.metrics_registry)
        # The live planner's gauges, as it publishes them (`cluster.traffic`), and its
        # view (`"planner"` of /admin/pools), handed to every router with its report.
        self.planner_gauges = PlannerGauges(self.metrics_registry)
        self.planner_view: dict[str, Any] | None = None
        # Every router's traffic totals, for the live planner.
        self.traffic_totals = TrafficTotals()
        self._changed = asyncio.Condition()
        self._loop_task: asyncio.Task | None = None
        self._starts: dict[str, asyncio.Task] = {}
        self._stops: dict[str, asyncio.Task] = {}
        self._metrics_runner: web.AppRunner | None = None
        self.metrics_url = ""
        self._role_resources = False
        self._advertise_node_ip = False
        # This node (`tandem serve`'s), whose CPUs `num_threads` counts; None when the
        # operator gave the threads (`--threads`): every worker runs those.
        self._home_node: str | None = None
        # Final load of each worker stopped after a drain (for admin views and tests).
        self.drained: dict[str, WorkerLoad] = {}

    # -- life of the controller ---------------------------------------------------------

    async def start(self) -> str:
        """Start the reconcile loop and the /metrics endpoint; returns its URL."""
        ray_config = self.config.ray
        if ray_config.role_resources is None:
            declared = ray.cluster_resources()
            self._role_resources = any(role_resource(r) in declared for r in self.state.targets)
        else:
            self._role_resources = ray_config.role_resources
        # Workers on a multi-node (or joined) Ray cluster bind and advertise their
        # node's address: loopback would not reach them from other nodes.
        alive_nodes = [node for node in ray.nodes() if node.get("Alive")]
        self._advertise_node_ip = ray_config.address is not None or len(alive_nodes) > 1
        if self.config.engine.num_threads is None:
            self._home_node = ray.get_runtime_context().get_node_id()
        await self._start_metrics()
        self._publish()
        self._loop_task = asyncio.create_task(self._reconcile_forever())
        return self.metrics_url

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop reconciling, then stop every worker (each drains its gRPC server)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        for task in [*self._starts.values(), *self._stops.values()]:
            task.cancel()
        records = list(self.state.records.values())
        stops = [self._stop_actor(r, timeout_s) for r in records]
        await asyncio.gather(*stops, return_exceptions=True)
        for record in records:
            self.state.remove(record.worker_id)
        self._publish()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None

    # -- what routers and admins call ----------------------------------------------------

    async def get_membership(self) -> Membership:
        return self.state.membership()

    async def watch(self, since_version: int, timeout_s: float) -> Membership:
        """The membership once its version is above `since_version` (or after
        `timeout_s`, whichever first): a long poll for routers."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.state.version > since_version),
                    timeout_s,
                )
        return self.state.membership()

    async def scale(
        self, targets: PoolTargets, if_targets: PoolTargets | None = None
    ) -> Membership:
        """Set new targets (checked whole first; nothing changes on a refusal); with
        `if_targets`, only while the targets are still those (`TargetsChanged`)."""
        current = self.state.membership().targets
        if if_targets is not None and current != if_targets:
            raise TargetsChanged(
                f"targets: {current} now, not {if_targets}; they changed meanwhile, nothing "
                "was resized"
            )
        wanted = self.state.check_targets(targets)
        self._check_capacity(wanted)
        self.state.set_targets(wanted)
        logger.info("pools: targets now %s", {r.value: n for r, n in wanted.items()})
        try:  # now: the reply shows the workers it starts, cancels or drains
            self._apply_plan()
        except Exception:  # the targets stand; the reconcile loop applies them again
            logger.exception("pools: applying the new targets failed; retrying next round")
        return self.state.membership()

    async def drain(self, worker_id: str) -> Membership:
        """Replace one serving worker (the target stays): it drains once its replacement
        serves, or at once where the cluster has no room for one more."""
        self.state.drain_target(worker_id)
        self._replace([worker_id], self.config.pools.replace_wait_s, "on request")
        self._reconcile_now()
        return self.state.membership()

    async def drain_node(self, node_id: str, deadline_s: float) -> Membership:
        """Move every worker off a Ray node that goes within `deadline_s` (a pod
        stopping): Ray places nothing new there, its serving workers are replaced
        elsewhere (waiting for the replacements at most half the deadline, so that their
        requests have the other half to finish), and one that comes up there later
        drains at once."""
        check_drainable(node_id)
        keep_new_actors_off(node_id, deadline_s)
        wait_s = min(self.config.pools.replace_wait_s, deadline_s / 2)
        on_node = self.state.drain_node(node_id, time.monotonic() + wait_s)
        self._replace(on_node, wait_s, f"its node {node_id} is going")
        self._reconcile_now()
        return self.state.membership()

    async def wait_at_target(self, timeout_s: float) -> Membership:
        """The membership once every role serves exactly its target with nothing
        starting or draining; TimeoutError past `timeout_s`."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(self.state.at_target), timeout_s)
        return self.state.membership()

    async def restarts(self) -> dict[str, int]:
        return {role.value: n for role, n in self.state.restarts.items()}

    async def drained_loads(self) -> dict[str, WorkerLoad]:
        return dict(self.drained)

    async def report_traffic(self, router_id: str, counters: Counters) -> dict[str, Any] | None:
        """A router's running traffic totals (`cluster.traffic.TrafficReporter`); the live
        planner's last view in return (None: no planner runs)."""
        self.traffic_totals.report(router_id, counters, time.monotonic())
        return self.planner_view

    async def traffic(self) -> Counters:
        """Every router's traffic totals, summed."""
        return self.traffic_totals.total()

    async def publish_plan(
        self,
        recommended: tuple[int, int] | None,
        predicted_rps: float | None,
        observed_rps: float,
        view: dict[str, Any],
    ) -> None:
        """The live planner's gauges, for this /metrics, and its view, for every router."""
        self.planner_view = view
        self.planner_gauges.observe(observed_rps)
        if recommended is not None and predicted_rps is not None:
            self.planner_gauges.recommend(recommended, predicted_rps)

    async def get_metrics_url(self) -> str:
        return self.metrics_url

    async def get_config(self) -> ClusterConfig:
        return self.config

    def _replace(self, worker_ids: list[str], wait_s: float, why: str) -> None:
        """Have serving workers replaced: each serves on until its replacement does (at
        most `wait_s`) while Ray has room for one more worker of its role (or an
        autoscaler can add a node), else it drains at once."""
        now_s = time.monotonic()
        free = None if self.config.ray.autoscaling else ray.available_resources()
        for worker_id in worker_ids:
            role = self.state.records[worker_id].role
            needs = self._worker_resources(role)
            room = free is None or all(free.get(name, 0.0) >= n for name, n in needs.items())
            if wait_s > 0 and room:
                if free is not None:  # the next worker's room is what this one leaves
                    for name, n in needs.items():
                        free[name] -= n
                self.state.replace(worker_id, now_s, wait_s)
                logger.info("pools: replacing %s (%s): it serves until a new %s worker does, "
                            "%g s at most", worker_id, why, role.value, wait_s)  # fmt: skip
            else:
                self.state.update(worker_id, now_s, state=WorkerLifecycle.DRAINING)
                logger.info("pools: draining %s (%s)", worker_id, why)

    def _worker_resources(self, role: WorkerRole) -> dict[str, float]:
        """The Ray resources one worker of `role` asks for."""
        needs = {"CPU": 1.0}
        if self.config.use_gpu:
            needs["GPU"] = self.config.ray.gpus_per_worker
        if self._role_resources:
            needs[role_resource(role)] = 1.0
        return needs

    # -- reconcile loop ------------------------------------------------------------------

    def _reconcile_now(self) -> None:
        self._publish()
        asyncio.get_running_loop().call_soon(self._apply_plan)

    async def _reconcile_forever(self) -> None:
        interval_s = self.config.pools.health_interval_s
        while True:
            try:
                await self._probe_all()
                self._drop_expired_dead()
                self._apply_plan()
                self._finish_drains()
            except Exception:  # one bad round must not end healing for good
                logger.exception("pools: reconcile round failed")
            await asyncio.sleep(interval_s)

    def _apply_plan(self) -> None:
        now_s = time.monotonic()
        plan = self.state.plan(now_s)
        for worker_id in plan.cancel:
            logger.info("pools: cancelling start of %s (target went down)", worker_id)
            start = self._starts.pop(worker_id, None)
            if start is not None:
                start.cancel()
            self._stop_later(self.state.remove(worker_id))
        for worker_id in plan.drain:
            logger.info("pools: draining %s (scale down)", worker_id)
            self.state.update(worker_id, now_s, state=WorkerLifecycle.DRAINING)
        for worker_id in plan.replaced:
            logger.info("pools: draining %s (replaced, or its wait for a replacement ran out)",
                        worker_id)  # fmt: skip
            self.state.update(worker_id, now_s, state=WorkerLifecycle.DRAINING)
        for role in plan.start:
            self._start_worker(role, now_s)
        self._publish()

    def _start_worker(self, role: WorkerRole, now_s: float) -> None:
        config = self.config
        worker_id = self.state.new_worker_id(role)
        engine = dataclasses.replace(config.engine, mode=role.engine_mode,
                                     num_threads=self.num_threads)  # fmt: skip
        worker_config = WorkerConfig(worker_id, role, engine, settings=config.worker)
        needs = self._worker_resources(role)
        # No task events: this controller probes every worker every second, and Ray's
        # GCS keeps ~3.4 KB per recorded call (the head grew 0.77 MiB a minute, idle
        # too), up to its 100,000-task cap.
        options: dict = {
            "num_cpus": needs.pop("CPU"),
            "max_restarts": 0,
            "enable_task_events": False,
        }
        if "GPU" in needs:
            options["num_gpus"] = needs.pop("GPU")
        if needs:
            options["resources"] = needs
        node_pools = self.node_pools(role)
        env = self.env_rule.env(role, node_pools) if self.env_rule is not None else {}
        if env:
            options["runtime_env"] = {"env_vars": env}
        away = None
        if self._home_node is not None:
            policy = self.config.ray.thread_policy
            away = AwayThreads(self._home_node, policy, node_pools.num_workers)
        actor = RemoteWorkerActor.options(**options).remote(
            worker_config, advertise_node_ip=self._advertise_node_ip, away=away
        )
        info = WorkerInfo(worker_id=worker_id, role=role, state=WorkerLifecycle.STARTING)
        self.state.add(WorkerRecord(info=info, actor=actor, since_s=now_s))
        self._starts[worker_id] = asyncio.create_task(self._bring_up(worker_id, actor))
        logger.info("pools: starting %s (worker env %s)", worker_id, env)

    def node_pools(self, role: WorkerRole) -> NodePools:
        """The workers a `role` worker starting now may share a node with, itself
        included: the targets then or the pools set at start, whichever are more (so a
        second decode worker that `tandem scale` adds on a node sleeps its OpenMP
        threads; the first keeps what it started with, a process's wait policy being
        fixed), and no more than one node that can take it holds by its role resources."""
        pools = self.start_pools.widest(NodePools.of_counts(self.state.targets))
        if self._role_resources and (most := node_capacity(role, ray.nodes())) is not None:
            pools = pools.capped(most)
        return pools

    async def _bring_up(self, worker_id: str, actor) -> None:
        timeout_s = self.config.ray.worker_start_timeout_s
        try:
            await asyncio.wait_for(actor.start.remote(), timeout_s)
            placement: WorkerPlacement = await asyncio.wait_for(actor.placement.remote(), 30.0)
        except asyncio.CancelledError:
            raise
        except (TimeoutError, ray.exceptions.RayError) as exc:
            logger.warning("pools: %s did not start: %s", worker_id, exc)
            self._starts.pop(worker_id, None)
            if worker_id in self.state.records:
                self._mark_dead(worker_id, time.monotonic())
                ray.kill(actor)
                self._reconcile_now()
            return
        self._starts.pop(worker_id, None)
        if worker_id not in self.state.records:  # cancelled meanwhile
            return
        state = self.state.came_up(
            worker_id,
            time.monotonic(),
            endpoint=placement.endpoint,
            metrics_url=placement.metrics_url,
            node=placement.node,
            pid=placement.pid,
            threads=placement.num_threads,
        )
        logger.info("pools: %s %s on %s (pid %d)", worker_id,
                    "serving" if state is WorkerLifecycle.SERVING else "up, draining at once: "
                    "its node is going,", placement.endpoint, placement.pid)  # fmt: skip
        self._reconcile_now()

    async def _probe_all(self) -> None:
        probed = (WorkerLifecycle.SERVING, WorkerLifecycle.DRAINING)
        records = [r for r in self.state.records.values() if r.state in probed]
        loads = await asyncio.gather(*(self._probe(r) for r in records))
        now_s = time.monotonic()
        for record, load in zip(records, loads, strict=True):
            if record.worker_id not in self.state.records or record.state not in probed:
                continue
            if isinstance(load, WorkerLoad):
                record.load, record.health_failures = load, 0
                continue
            failures = record.health_failures + 1
            if load == "exited" or failures >= self.config.pools.max_health_failures:
                logger.warning("pools: %s is dead (%s)", record.worker_id, load)
                self._mark_dead(record.worker_id, now_s)
                ray.kill(record.actor)
            else:
                record.health_failures = failures
                logger.warning("pools: %s missed a health probe (%d in a row)",
                               record.worker_id, record.health_failures)  # fmt: skip
        self._publish()

    def _mark_dead(self, worker_id: str, now_s: float) -> None:
        role = self.state.records[worker_id].role
        if self.state.mark_dead(worker_id, now_s):
            held_s = self.state.backoff.held_s(role, now_s)
            if held_s > 0:
                logger.warning("pools: %d %s workers in a row died young; the next starts "
                               "in %.0f s (restart backoff)", self.state.backoff.failures[role],
                               role.value, held_s)  # fmt: skip

    async def _probe(self, record: WorkerRecord) -> WorkerLoad | str:
        try:
            return await asyncio.wait_for(
                record.actor.load.remote(), self.config.pools.health_timeout_s
            )
        except ray.exceptions.RayActorError:
            return "exited"
        except (TimeoutError, ray.exceptions.RayError) as exc:
            return f"probe failed: {exc!r}"[:200]

    def _drop_expired_dead(self) -> None:
        now_s = time.monotonic()
        for worker_id in self.state.expired_dead(now_s, self.config.pools.dead_retention_s):
            self.state.remove(worker_id)

    def _finish_drains(self) -> None:
        now_s = time.monotonic()
        for record in list(self.state.records.values()):
            if record.state is not WorkerLifecycle.DRAINING or record.worker_id in self._stops:
                continue
            draining_s = now_s - record.since_s
            overdue = draining_s >= self.config.pools.drain_timeout_s
            settled = draining_s >= self.config.pools.drain_min_s and record.load.is_idle
            if settled or overdue:
                if overdue and not record.load.is_idle:
                    logger.warning("pools: %s still busy after the drain timeout; stopping it "
                                   "(routers move its requests)", record.worker_id)  # fmt: skip
                self._stops[record.worker_id] = asyncio.create_task(self._retire(record))

    async def _retire(self, record: WorkerRecord) -> None:
        """Stop a drained worker, then drop it from the pools."""
        try:
            load = await asyncio.wait_for(record.actor.load.remote(), 10.0)
            self.drained[record.worker_id] = load
            if load.num_free_blocks != load.num_blocks:
                logger.warning("pools: %s stops with %d of %d blocks in use", record.worker_id,
                               load.num_blocks - load.num_free_blocks, load.num_blocks)  # fmt: skip
        except (TimeoutError, ray.exceptions.RayError) as exc:
            logger.warning("pools: last probe of %s failed: %s", record.worker_id, exc)
        await self._stop_actor(record, self.config.worker.drain_timeout_s + 10.0)
        self._stops.pop(record.worker_id, None)
        if record.worker_id in self.state.records:
            self.state.remove(record.worker_id)
        logger.info("pools: %s drained and stopped", record.worker_id)
        self._publish()

    def _stop_later(self, record: WorkerRecord) -> None:
        task = asyncio.create_task(self._stop_actor(record, 10.0))
        self._stops[record.worker_id] = task
        task.add_done_callback(lambda _: self._stops.pop(record.worker_id, None))

    async def _stop_actor(self, record: WorkerRecord, timeout_s: float) -> None:
        if record.actor is None:
            return
        # A worker still starting has served nothing: killed at once, it gives its Ray
        # resources back at once (a graceful stop waited for its start, up to
        # `timeout_s`, and meanwhile Ray had no room for a replacement elsewhere).
        if record.state not in (WorkerLifecycle.DEAD, WorkerLifecycle.STARTING):
            try:
                await asyncio.wait_for(record.actor.stop.remote(), timeout_s)
            except (TimeoutError, ray.exceptions.RayError) as exc:
                logger.warning("pools: %s did not stop cleanly: %s", record.worker_id, exc)
        ray.kill(record.actor)

    # -- capacity and publishing ---------------------------------------------------------

    def _check_capacity(self, wanted: dict[WorkerRole, int]) -> None:
        """RuntimeError naming the field when the Ray cluster can never place `wanted`."""
        if self.config.ray.autoscaling:
            return
        total = ray.cluster_resources()
        if self._role_resources:
            for role, target in wanted.items():
                have = int(total.get(role_resource(role), 0))
                if target > have:
                    raise RuntimeError(
                        f"{role.value}: {target} workers, but the Ray cluster has room for "
                        f"{have} ({role_resource(role)} resources)"
                    )
        # Draining workers still hold their CPU until they stop, but they go.
        needed_cpus = sum(wanted.values())
        have_cpus = int(total.get("CPU", 0))
        if needed_cpus > have_cpus:
            raise RuntimeError(
                f"prefill+decode: {needed_cpus} workers need {needed_cpus} CPUs; "
                f"the Ray cluster has {have_cpus}"
            )
        if self.config.use_gpu:
            needed_gpus = needed_cpus * self.config.ray.gpus_per_worker
            have_gpus = total.get("GPU", 0.0)
            if needed_gpus > have_gpus:
                raise RuntimeError(
                    f"prefill+decode: {needed_cpus} workers need {needed_gpus:g} GPUs; "
                    f"the Ray cluster has {have_gpus:g}"
                )

    def _publish(self) -> None:
        """Wake watchers and refresh the gauges (cheap; called after every change)."""
        targets = {role.value: n for role, n in self.state.targets.items()}
        self.gauges.update(self.state.membership(), targets)

        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()

        asyncio.get_running_loop().create_task(notify())

    async def _start_metrics(self) -> None:
        async def scrape(request: web.Request) -> web.Response:
            body = generate_latest(self.metrics_registry)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", scrape)
        self._metrics_runner = web.AppRunner(app)
        await self._metrics_runner.setup()
        host = self.config.worker.host
        if self._advertise_node_ip:
            host = node_host(host, ray.util.get_node_ip_address())
        await web.TCPSite(self._metrics_runner, host, self.config.pools.metrics_port).start()
        port = self._metrics_runner.addresses[0][1]
        self.metrics_url = f"http://{host}:{port}/metrics"
        logger.info("pools: controller metrics on %s (pid %d)", self.metrics_url, os.getpid())


# Applied as a call, not a decorator, so mypy sees Ray's typed `ActorClass` (with
# `.options` / `.remote`). The options are the ones the decorator had.
RemotePoolController = ray.remote(num_cpus=0, max_restarts=0)(PoolController)
