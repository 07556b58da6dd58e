"""Starts a Tandem cluster on Ray: a placement group, one actor per worker, a router.

`LocalCluster` starts a local Ray instance (or joins `ray_address`), reserves one
bundle per worker (`{"GPU": 1}` on GPU machines, `{"CPU": 1}` otherwise), starts each
worker as a `WorkerActor` that reports its gRPC endpoint, then runs the router in this
process. `stop()` drains and releases everything it created, Ray included if it
started it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.cluster.config import ClusterConfig
from tandem.cluster.worker_actor import RemoteWorkerActor
from tandem.router.server import Router
from tandem.router.worker_pool import WorkerEndpoint
from tandem.worker.config import WorkerConfig, WorkerRole

logger = logging.getLogger(__name__)

__all__ = ["ClusterConfig", "LocalCluster"]


class LocalCluster:
    """Owns the Ray placement group, the worker actors and the router."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.router: Router | None = None
        self.workers: list[WorkerEndpoint] = []
        self._actors: list = []
        self._pg: PlacementGroup | None = None
        self._started_ray = False

    async def start(self) -> Router:
        """Start the workers, then the router; returns the running router."""
        config = self.config
        roles = config.roles
        self._init_ray(len(roles))
        bundle = {"GPU": config.ray.gpus_per_worker, "CPU": 1} if config.use_gpu else {"CPU": 1}
        self._pg = pg = placement_group([dict(bundle) for _ in roles], strategy="PACK")
        await asyncio.wait_for(pg.ready(), config.ray.worker_start_timeout_s)
        threads = config.engine.num_threads or max(1, (os.cpu_count() or 1) // len(roles))
        counters: dict[WorkerRole, int] = {}
        for index, role in enumerate(roles):
            counters[role] = counters.get(role, 0) + 1
            worker_id = f"{role.value}-{counters[role] - 1}"
            actor = RemoteWorkerActor.options(
                name=None,
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, index),
            ).remote(self._worker_config(worker_id, role, threads))
            self._actors.append(actor)
            self.workers.append(WorkerEndpoint(worker_id, role, ""))
        endpoints = await asyncio.wait_for(
            asyncio.gather(*(actor.start.remote() for actor in self._actors)),
            config.ray.worker_start_timeout_s,
        )
        self.workers = [
            WorkerEndpoint(w.worker_id, w.role, endpoint)
            for w, endpoint in zip(self.workers, endpoints, strict=True)
        ]
        # The router learns block size and max model length from the workers' Stats.
        self.router = router = Router(config.router, self.workers)
        await router.start()
        return router

    def _init_ray(self, num_workers: int) -> None:
        if ray.is_initialized():
            return
        if self.config.ray.address:
            ray.init(address=self.config.ray.address, log_to_driver=False)
        else:
            # Logical CPUs: one bundle per worker even when workers outnumber cores.
            num_cpus = max(os.cpu_count() or 1, num_workers)
            # "local" starts a fresh instance; no address would join whatever Ray
            # instance `ray start` left on this machine (and refuse num_cpus there).
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=False,
            )
            self._started_ray = True

    def _worker_config(self, worker_id: str, role: WorkerRole, threads: int) -> WorkerConfig:
        config = self.config
        engine = dataclasses.replace(config.engine, mode=role.engine_mode, num_threads=threads)
        return WorkerConfig(worker_id=worker_id, role=role, engine=engine, settings=config.worker)

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Drain the router and workers, then release actors, placement group and Ray."""
        if self.router is not None:
            await self.router.stop()
            self.router = None
        if self._actors:
            stops = asyncio.gather(*(actor.stop.remote() for actor in self._actors))
            try:
                await asyncio.wait_for(stops, timeout_s)
            except (TimeoutError, ray.exceptions.RayError) as exc:
                logger.warning("workers did not stop cleanly: %s", exc)
            for actor in self._actors:
                ray.kill(actor)
            self._actors.clear()
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
