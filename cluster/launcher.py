"""Starts a Tandem cluster on Ray: a placement group, one actor per worker, a router.

`LocalCluster` starts a local Ray instance (or joins `ray_address`), reserves one
bundle per worker (`{"GPU": 1}` on GPU machines, `{"CPU": 1}` otherwise), starts each
worker as a `WorkerActor` that reports its gRPC endpoint, then runs the router in this
process. `stop()` drains and releases everything it created, Ray included if it
started it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.cluster.worker_actor import WorkerActor
from tandem.engine.config import EngineConfig
from tandem.router.config import RouterConfig
from tandem.router.server import Router
from tandem.router.worker_pool import WorkerEndpoint
from tandem.worker.config import WorkerConfig, WorkerRole

logger = logging.getLogger(__name__)


@dataclass
class ClusterConfig:
    model_dir: str
    num_prefill: int = 1
    num_decode: int = 1
    # When > 0: this many colocated workers and no prefill/decode split.
    num_colocated: int = 0
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    # Join an existing Ray cluster ("auto" or host:port); None starts a local one.
    ray_address: str | None = None
    # "cpu" or "cuda"; None = cuda when available.
    device: str | None = None
    # KV transfer backend; None = nccl on cuda, tcp on cpu.
    kv_backend: str | None = None
    # Engine settings applied to every worker (EngineConfig field -> value).
    engine_overrides: dict = field(default_factory=dict)
    # GPUs per worker bundle; a fraction lets several workers share one GPU.
    gpus_per_worker: float = 1.0
    # torch threads per worker process; None = cores / workers (at least 1).
    threads_per_worker: int | None = None
    worker_start_timeout_s: float = 600.0
    kv_lease_s: float = 30.0
    # Router: optional API key of the HTTP API; OpenTelemetry exporter of every process.
    api_key: str | None = None
    trace_exporter: str = "none"
    # Other RouterConfig fields (admission_policy, ttft_slo_s, ...).
    router_overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        gpus = self.gpus_per_worker
        if gpus <= 0 or (gpus > 1 and not float(gpus).is_integer()):
            raise ValueError(f"gpus_per_worker must be in (0, 1] or a whole number, got {gpus}")
        if self.num_colocated < 0 or self.num_prefill < 0 or self.num_decode < 0:
            raise ValueError("worker counts must be >= 0")
        if self.num_colocated == 0 and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError("a disaggregated cluster needs >= 1 prefill and >= 1 decode worker")
        if self.device is None:
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.kv_backend is None:
            self.kv_backend = "nccl" if self.device.startswith("cuda") else "tcp"

    @property
    def roles(self) -> list[WorkerRole]:
        if self.num_colocated:
            return [WorkerRole.COLOCATED] * self.num_colocated
        return [WorkerRole.PREFILL] * self.num_prefill + [WorkerRole.DECODE] * self.num_decode


class LocalCluster:
    """Owns the Ray placement group, the worker actors and the router."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.router: Router | None = None
        self.workers: list[WorkerEndpoint] = []
        self._actors: list = []
        self._pg = None
        self._started_ray = False

    async def start(self) -> None:
        config = self.config
        roles = config.roles
        self._init_ray(len(roles))
        use_gpu = config.device.startswith("cuda")
        bundle = {"GPU": config.gpus_per_worker, "CPU": 1} if use_gpu else {"CPU": 1}
        self._pg = placement_group([dict(bundle) for _ in roles], strategy="PACK")
        await asyncio.wait_for(self._pg.ready(), config.worker_start_timeout_s)
        threads = config.threads_per_worker or max(1, (os.cpu_count() or 1) // len(roles))
        counters: dict[WorkerRole, int] = {}
        for index, role in enumerate(roles):
            counters[role] = counters.get(role, 0) + 1
            worker_id = f"{role.value}-{counters[role] - 1}"
            actor = WorkerActor.options(
                name=None,
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, index),
            ).remote(self._worker_config(worker_id, role, threads))
            self._actors.append(actor)
            self.workers.append(WorkerEndpoint(worker_id, role.value, ""))
        endpoints = await asyncio.wait_for(
            asyncio.gather(*(actor.start.remote() for actor in self._actors)),
            config.worker_start_timeout_s,
        )
        self.workers = [
            WorkerEndpoint(w.worker_id, w.role, endpoint)
            for w, endpoint in zip(self.workers, endpoints, strict=True)
        ]
        router_config = RouterConfig(
            model_dir=config.model_dir,
            host=config.host,
            grpc_port=config.grpc_port,
            http_port=config.http_port,
            max_model_len=config.engine_overrides.get("max_model_len"),
            api_key=config.api_key,
            trace_exporter=config.trace_exporter,
            block_size=config.engine_overrides.get("block_size", 16),
            **config.router_overrides,
        )
        self.router = Router(router_config, self.workers)
        await self.router.start()

    def _init_ray(self, num_workers: int) -> None:
        if ray.is_initialized():
            return
        if self.config.ray_address:
            ray.init(address=self.config.ray_address, log_to_driver=False)
        else:
            # Logical CPUs: one bundle per worker even when workers outnumber cores.
            num_cpus = max(os.cpu_count() or 1, num_workers)
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
            self._started_ray = True

    def _worker_config(self, worker_id: str, role: WorkerRole, threads: int) -> WorkerConfig:
        config = self.config
        engine = EngineConfig(
            model=config.model_dir,
            mode=role.engine_mode,
            device=config.device,
            num_threads=threads,
            kv_lease_s=config.kv_lease_s,
            **config.engine_overrides,
        )
        return WorkerConfig(
            worker_id=worker_id,
            role=role,
            engine=engine,
            host=config.host,
            kv_backend=config.kv_backend,
            trace_exporter=config.trace_exporter,
        )

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
