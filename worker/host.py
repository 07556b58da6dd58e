"""What every worker process runs around its role's services.

`WorkerHost` owns the engine (on its `EngineLoop` thread), the gRPC server with the
standard health service, the Prometheus `/metrics` endpoint and the tracer. Prefill
and decode workers open it, register their own services, then `serve()`; on stop
they `close_server()` (drain), free their own resources, then `close()`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.engine.llm_engine import Engine
from tandem.proto.cluster_auth import add_internal_port, internal_server
from tandem.telemetry.tracing import Tracing
from tandem.worker.config import WorkerConfig
from tandem.worker.engine_loop import EngineLoop
from tandem.worker.metrics import WorkerMetrics

logger = logging.getLogger(__name__)


class WorkerHost:
    def __init__(
        self,
        config: WorkerConfig,
        tracing: Tracing | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        # The engine's clock (KV leases); tests pass a fake one to expire leases at once.
        self.clock = clock
        self.tracing = tracing or Tracing(f"tandem-{config.worker_id}", config.trace_exporter)
        self.metrics = WorkerMetrics(config.worker_id, config.role.value)
        self.endpoint = ""
        self.loop: EngineLoop | None = None
        self.server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None

    async def open(self) -> EngineLoop:
        """Load the model, start the engine thread, bind the gRPC server (not serving yet)."""
        config = self.config
        # Built on the engine's own thread (see EngineLoop): start() waits for the load.
        build = functools.partial(Engine, config.engine, clock=self.clock)
        self.loop = EngineLoop(
            build, name=f"engine-{config.worker_id}", step_watchdog_s=config.step_watchdog_s
        )
        await asyncio.to_thread(self.loop.start)
        # Every call but health probes must carry the cluster token (when one is set).
        self.server = internal_server(
            config.cluster_auth, on_refused=functools.partial(self.metrics.refused, "grpc")
        )
        port = add_internal_port(self.server, f"{config.host}:{config.port}", config.cluster_auth)
        self.endpoint = f"{config.host}:{port}"
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        return self.loop

    async def serve(self) -> str:
        """Start serving (services registered by then); returns the gRPC endpoint."""
        config = self.config
        if self.server is None or self.loop is None or self._health is None:
            raise RuntimeError("WorkerHost.serve() called before open()")
        await self.server.start()
        await self.metrics.start(self.loop, config.host, config.metrics_port)
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        logger.info("%s worker %s serving on %s", config.role.value, config.worker_id,
                    self.endpoint)  # fmt: skip
        return self.endpoint

    async def close_server(self) -> None:
        """Finish in-flight calls (up to the drain timeout); stop /metrics."""
        if self.server is not None:
            await self.server.stop(self.config.drain_timeout_s)
        await self.metrics.stop()

    def close(self) -> None:
        """Stop the engine thread and flush the tracer (after the role's own cleanup)."""
        if self.loop is not None:
            self.loop.stop()
        self.tracing.shutdown()
