"""The Ray actor that hosts one worker's gRPC server (one actor per worker process).

The pool controller starts it, probes it with `load()` (a health check that also
reports the engine's load) and stops it after a drain.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
from typing import TYPE_CHECKING

import ray
import torch

from tandem.cluster.pool_state import WorkerLoad
from tandem.cluster.threads import AwayThreads
from tandem.worker.config import WorkerConfig, WorkerRole

if TYPE_CHECKING:
    from tandem.decode_worker.server import DecodeWorker
    from tandem.prefill_worker.server import PrefillWorker

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorkerPlacement:
    """Where a started worker runs and answers."""

    endpoint: str
    metrics_url: str
    # Ray node id (hex) of the worker's node.
    node: str
    pid: int
    # torch threads the worker's engine runs.
    num_threads: int


def node_host(configured_host: str, node_ip: str) -> str:
    """The address a worker binds and advertises: the Ray node's own address when the
    configured one is loopback but the node is not (other nodes could not reach it)."""
    try:
        configured_loopback = ipaddress.ip_address(configured_host).is_loopback
        node_loopback = ipaddress.ip_address(node_ip).is_loopback
    except ValueError:  # a host name: the operator chose it
        return configured_host
    return node_ip if configured_loopback and not node_loopback else configured_host


class WorkerActor:
    """Async actor: its event loop runs the worker's grpc.aio server for its lifetime."""

    def __init__(
        self,
        config: WorkerConfig,
        advertise_node_ip: bool = False,
        away: AwayThreads | None = None,
    ) -> None:
        """`away`: how the worker counts its threads off `tandem serve`'s node (None: the
        operator gave them, `--threads`)."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        if advertise_node_ip:
            host = node_host(config.settings.host, ray.util.get_node_ip_address())
            if host != config.settings.host:
                settings = dataclasses.replace(config.settings, host=host)
                config = dataclasses.replace(config, settings=settings)
        # Ray is asked only then: tests build the actor without Ray.
        threads = away.on(ray.get_runtime_context().get_node_id()) if away is not None else None
        if threads is not None and threads != config.engine.num_threads:
            logger.info("%s: %d torch threads, counted on this node (%s on the serve node)",
                        config.worker_id, threads, config.engine.num_threads)  # fmt: skip
            engine = dataclasses.replace(config.engine, num_threads=threads)
            config = dataclasses.replace(config, engine=engine)
        self.config = config
        self.worker: PrefillWorker | DecodeWorker | None = None

    async def start(self) -> str:
        """Load the model and serve; returns the worker's gRPC endpoint."""
        if self.config.role is WorkerRole.PREFILL:
            from tandem.prefill_worker.server import PrefillWorker

            self.worker = PrefillWorker(self.config)
        else:
            from tandem.decode_worker.server import DecodeWorker

            self.worker = DecodeWorker(self.config)
        return await self.worker.start()

    async def placement(self) -> WorkerPlacement:
        """Endpoint, metrics URL, node and pid of the started worker."""
        if self.worker is None:
            raise RuntimeError(f"{self.config.worker_id}: placement() before start()")
        return WorkerPlacement(
            endpoint=self.worker.endpoint,
            metrics_url=f"{self.worker.metrics.endpoint}/metrics",
            node=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            # What its engine was told to run (torch's count is per OpenMP thread).
            num_threads=self.config.engine.num_threads or torch.get_num_threads(),
        )

    async def load(self) -> WorkerLoad:
        """The engine's load, answered at once; the health check: raises if the engine
        thread is gone or one step has run past the step watchdog (a long step within
        it is healthy)."""
        if self.worker is None or self.worker.host.loop is None:
            raise RuntimeError(f"{self.config.worker_id}: load() before start()")
        loop = self.worker.host.loop
        loop.check_health()
        stats = loop.stats()
        return WorkerLoad(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_held=stats.num_held,
            num_importing=stats.num_importing,
            num_free_blocks=stats.num_free_blocks,
            num_blocks=stats.num_blocks,
        )

    async def stop(self) -> None:
        if self.worker is not None:
            await self.worker.stop()
            self.worker = None

    def pid(self) -> int:
        return os.getpid()


# Applied as a call, not a decorator, so mypy sees Ray's typed `ActorClass` (with
# `.options` / `.remote`) rather than the plain class.
RemoteWorkerActor = ray.remote(WorkerActor)
