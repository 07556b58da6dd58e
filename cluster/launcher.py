"""Starts a Tandem cluster on Ray: the pool controller (which starts the workers) and a router.

`LocalCluster` starts a local Ray instance (or joins `ray_address`), starts the named
`PoolController` actor on this process's node with the starting targets, waits until
they serve, then runs a router in this process that follows the controller's
membership. A controller that dies (its process killed, out of memory) takes its workers
with it (Ray ends the actors an actor created); the cluster then starts a new one with
the targets the old one last had, which starts new workers, and every router follows it
by name, so streams migrate to the new workers once they serve. `stop()` drains and
releases everything it created, Ray included if it started it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tandem.cluster.config import ClusterConfig, role_resource
from tandem.cluster.controller_link import ControllerLink
from tandem.cluster.pool_controller import (
    CONTROLLER_NAME,
    CONTROLLER_NAMESPACE,
    CONTROLLER_REPLY_S,
    RemotePoolController,
)
from tandem.cluster.ray_start import join_ray, start_local_ray
from tandem.cluster.router_process import AttachedRouter, serving_endpoints
from tandem.cluster.threads import threads_per_worker
from tandem.cluster.worker_env import WorkerEnvRule
from tandem.engine.host_cpus import available_cpus
from tandem.router.membership import Membership
from tandem.router.server import Router
from tandem.router.worker_pool import WorkerEndpoint

logger = logging.getLogger(__name__)

__all__ = ["ClusterConfig", "LocalCluster"]


def release_name(dead: Any) -> None:
    """Free a dead controller's name for the next one: Ray keeps the name of an actor
    whose process was killed (`kill -9`, the OOM killer) taken while handles to it live
    (this cluster's, its routers'), so a new controller by that name was refused on
    every try and a served cluster stayed down until stopped; `ray.kill` of the dead
    handle releases the name at once."""
    try:
        ray.kill(dead, no_restart=True)
    except (ValueError, ray.exceptions.RayError) as exc:
        logger.warning("could not release the dead pool controller's name (%s)", exc)


class LocalCluster:
    """Owns the pool controller (and through it the workers) and one router."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.router: Router | None = None
        # The serving workers at start (the controller's membership is the live view).
        self.workers: list[WorkerEndpoint] = []
        self.controller: Any = None
        self.controller_metrics_url = ""
        self._attached: AttachedRouter | None = None
        self._started_ray = False
        # Starts a new controller when the running one dies (see the module doc).
        self._keeper: asyncio.Task[None] | None = None
        # Pool controllers started after the first one died.
        self.num_controller_restarts = 0
        # The pools as the controller keeper last read them (a new controller gets their
        # targets).
        self.kept_membership: Membership | None = None
        self._threads = 1
        # What the controller decides each worker's environment from (`cluster.worker_env`).
        self._env_rule: WorkerEnvRule | None = None

    async def start(self) -> Router:
        """Start the workers, then the router; returns the running router."""
        config = self.config
        roles = config.roles
        self._init_ray()
        num_cores = available_cpus()
        threads = config.engine.num_threads or threads_per_worker(
            config.ray.thread_policy, num_cores, len(roles)
        )
        source = "--threads" if config.engine.num_threads else config.ray.thread_policy.value
        logger.info("torch threads per worker: %d (%s)", threads, source)
        self._threads = threads
        self._env_rule = WorkerEnvRule.of(threads, num_cores, config.engine.device, os.environ)
        await self._start_controller(config)
        timeout_s = config.ray.worker_start_timeout_s
        membership: Membership = await asyncio.wait_for(
            self.controller.wait_at_target.remote(timeout_s), timeout_s + CONTROLLER_REPLY_S
        )
        self.workers = serving_endpoints(membership)
        self._attached = AttachedRouter(config.router, self.controller)
        # The router learns block size and max model length from the workers' Stats.
        self.router = router = await self._attached.start(timeout_s)
        self._keeper = asyncio.create_task(self._keep_controller(membership))
        return router

    async def _start_controller(self, config: ClusterConfig) -> None:
        """Start the named pool controller, which starts the workers of `config`'s pools."""
        # Not detached: the controller (and the workers it owns) go with this process.
        # On this process's node: Ray would place an actor that asks for no CPU on any
        # node, and the controller's workers die with it when that node goes (a worker
        # pod stopping); the head pod also serves the controller's metrics port.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        # No task events: every router calls it every second (traffic reports, membership
        # polls), and Ray's GCS keeps ~3.4 KB per recorded call.
        self.controller = RemotePoolController.options(
            name=CONTROLLER_NAME,
            namespace=CONTROLLER_NAMESPACE,
            scheduling_strategy=here,
            enable_task_events=False,
        ).remote(config, self._threads, self._env_rule)
        # The first call also waits for the controller's process to start.
        self.controller_metrics_url = await asyncio.wait_for(
            self.controller.start.remote(),
            config.ray.worker_start_timeout_s + CONTROLLER_REPLY_S,
        )

    async def _keep_controller(
        self, membership: Membership, watch_s: float = 10.0, retry_s: float = 1.0
    ) -> None:
        """Follow the controller's membership (a long poll: its death fails the pending
        call at once); when it is dead, start a new one with the pool targets it last
        reported (its workers died with it)."""
        following = self.controller
        while True:
            if self.controller is not following:  # a new one counts its versions anew
                following, membership = self.controller, dataclasses.replace(membership, version=0)
            self.kept_membership = membership
            try:
                membership = await asyncio.wait_for(
                    self.controller.watch.remote(membership.version, watch_s),
                    watch_s + CONTROLLER_REPLY_S,
                )
                continue
            except ray.exceptions.ActorUnavailableError as exc:  # (a RayActorError too)
                logger.warning("pool controller unreachable for now (%s)", exc)
                await asyncio.sleep(retry_s)
                continue
            except ray.exceptions.RayActorError as exc:
                reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            except (TimeoutError, ray.exceptions.RayError) as exc:
                logger.warning("pool controller did not answer its check (%s)", exc)
                await asyncio.sleep(retry_s)
                continue
            logger.error(
                "the pool controller died (%s) and its workers with it; starting a new one "
                "with targets %s", reason, membership.targets or self.config.pools.roles,
            )  # fmt: skip
            release_name(self.controller)
            try:
                await self._start_controller(self._config_at(membership))
            except (TimeoutError, ValueError, ray.exceptions.RayError) as exc:
                # ValueError: the dead one's name is not free yet. Tried again next check.
                logger.error("could not start a new pool controller (%s); retrying", exc)
                await asyncio.sleep(retry_s)
                continue
            self.num_controller_restarts += 1

    def _config_at(self, membership: Membership) -> ClusterConfig:
        """The cluster config with the pool targets `membership` reports (the starting
        ones for colocated pools, whose targets it does not carry)."""
        targets = membership.targets
        if targets is None:
            return self.config
        pools = dataclasses.replace(
            self.config.pools, num_prefill=targets.prefill, num_decode=targets.decode
        )
        return dataclasses.replace(self.config, pools=pools)

    @property
    def controller_link(self) -> ControllerLink:
        """The link this cluster's router keeps to the pool controller (started)."""
        if self._attached is None:
            raise RuntimeError("the cluster is not started")
        return self._attached.link

    @property
    def ray_address(self) -> str:
        """The GCS address `tandem router --ray-address` joins."""
        return ray.get_runtime_context().gcs_address

    async def membership(self) -> Membership:
        return await asyncio.wait_for(self.controller.get_membership.remote(), CONTROLLER_REPLY_S)

    def _init_ray(self) -> None:
        if ray.is_initialized():
            return
        if self.config.ray.address:
            join_ray(self.config.ray.address)
            return
        pools = self.config.pools
        roles = sorted(set(pools.roles))
        budget = pools.max_workers_per_role
        # Logical CPUs: one per worker even when workers outnumber cores, so every
        # role can reach its budget; one role resource per worker the budget allows.
        num_cpus = max(os.cpu_count() or 1, budget * len(roles))
        resources = {role_resource(role): float(budget) for role in roles}
        start_local_ray(num_cpus=num_cpus, resources=resources)
        self._started_ray = True

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the router, then the controller (it drains and stops the workers), then Ray."""
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
            self._keeper = None
        if self._attached is not None:
            await self._attached.stop()
            self._attached = None
            self.router = None
        if self.controller is not None:
            try:
                await asyncio.wait_for(self.controller.shutdown.remote(timeout_s), timeout_s + 10)
            except (TimeoutError, ray.exceptions.RayError) as exc:
                logger.warning("pool controller did not stop cleanly: %s", exc)
            ray.kill(self.controller)
            self.controller = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
