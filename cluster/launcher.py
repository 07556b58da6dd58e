"""Starts a Tandem cluster on Ray: the pool controller (which starts the workers) and a router.

`LocalCluster` starts a local Ray instance (or joins `ray_address`), starts the named
`PoolController` actor on this process's node with the starting targets, waits until
they serve, then runs a router in this process that follows the controller's
membership. `stop()` drains and releases everything it created, Ray included if it
started it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from tandem.cluster.config import ClusterConfig, ThreadPolicy, role_resource
from tandem.cluster.controller_link import ControllerLink
from tandem.cluster.pool_controller import (
    CONTROLLER_NAME,
    CONTROLLER_NAMESPACE,
    CONTROLLER_REPLY_S,
    RemotePoolController,
)
from tandem.cluster.ray_start import check_reachable, start_local_ray
from tandem.cluster.router_process import AttachedRouter, serving_endpoints
from tandem.cluster.worker_env import worker_env_vars
from tandem.router.membership import Membership
from tandem.router.server import Router
from tandem.router.worker_pool import WorkerEndpoint

logger = logging.getLogger(__name__)

__all__ = ["ClusterConfig", "LocalCluster"]


def threads_per_worker(policy: ThreadPolicy, num_cores: int, num_workers: int) -> int:
    """torch intra-op threads of each worker on a node of `num_cores` cores running
    `num_workers` workers (the starting pools)."""
    if policy is ThreadPolicy.SHARED:
        return max(1, num_cores)
    return max(1, num_cores // max(1, num_workers))


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

    async def start(self) -> Router:
        """Start the workers, then the router; returns the running router."""
        config = self.config
        roles = config.roles
        self._init_ray()
        num_cores = os.cpu_count() or 1
        threads = config.engine.num_threads or threads_per_worker(
            config.ray.thread_policy, num_cores, len(roles)
        )
        source = "--threads" if config.engine.num_threads else config.ray.thread_policy.value
        env = {
            role: worker_env_vars(
                role, threads, len(roles), num_cores, config.engine.device, os.environ
            )
            for role in set(roles)
        }
        logger.info("torch threads per worker: %d (%s); worker env %s", threads, source, env)
        # Not detached: the controller (and the workers it owns) go with this process.
        # On this process's node: Ray would place an actor that asks for no CPU on any
        # node, and the controller's workers die with it when that node goes (a worker
        # pod stopping); the head pod also serves the controller's metrics port.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.controller = RemotePoolController.options(
            name=CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE, scheduling_strategy=here
        ).remote(config, threads, env)
        timeout_s = config.ray.worker_start_timeout_s
        # The first call also waits for the controller's process to start.
        self.controller_metrics_url = await asyncio.wait_for(
            self.controller.start.remote(), timeout_s + CONTROLLER_REPLY_S
        )
        membership: Membership = await asyncio.wait_for(
            self.controller.wait_at_target.remote(timeout_s), timeout_s + CONTROLLER_REPLY_S
        )
        self.workers = serving_endpoints(membership)
        self._attached = AttachedRouter(config.router, self.controller)
        # The router learns block size and max model length from the workers' Stats.
        self.router = router = await self._attached.start(timeout_s)
        return router

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
            check_reachable(self.config.ray.address)
            ray.init(address=self.config.ray.address, log_to_driver=False)
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
