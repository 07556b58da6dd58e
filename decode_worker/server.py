"""A decode (or colocated) worker process: engine thread + gRPC server (DecodeWorker, health)."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from decode_worker.service import DecodeService
from engine.engine_loop import EngineLoop
from engine.llm_engine import Engine
from engine.tracing import Tracing
from engine.worker_config import WorkerConfig, WorkerRole
from engine.worker_metrics import WorkerMetrics
from kv_transfer.client import KvTransferClient
from kv_transfer.layout import KvLayout
from proto.server_options import GRPC_OPTIONS
from proto.tandem.worker.v1 import worker_pb2_grpc

logger = logging.getLogger(__name__)


class DecodeWorker:
    """Owns the engine loop, the KV transfer client and the gRPC server."""

    def __init__(self, config: WorkerConfig, tracing: Tracing | None = None) -> None:
        if config.role not in (WorkerRole.DECODE, WorkerRole.COLOCATED):
            raise ValueError(
                f"DecodeWorker needs role decode or colocated, got {config.role.value}"
            )
        self.config = config
        self.tracing = tracing or Tracing(f"tandem-{config.worker_id}", config.trace_exporter)
        self.endpoint = ""
        self.metrics = WorkerMetrics(config.worker_id, config.role.value)
        self._loop: EngineLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._kv_client: KvTransferClient | None = None
        self._service: DecodeService | None = None

    async def start(self) -> str:
        """Load the model, start serving; returns the gRPC endpoint host:port."""
        config = self.config
        engine = await asyncio.to_thread(Engine, config.engine)
        self._loop = loop = EngineLoop(engine, name=f"engine-{config.worker_id}")
        loop.start()
        layout = KvLayout.from_engine_config(config.engine)
        self._kv_client = KvTransferClient(
            layout, config.worker_id, backend=config.kv_backend, timeout_s=config.pull_timeout_s
        )
        self._server = server = grpc.aio.server(options=GRPC_OPTIONS)
        port = server.add_insecure_port(f"{config.host}:{config.port}")
        self.endpoint = f"{config.host}:{port}"
        self._service = DecodeService(config, loop, self._kv_client, self.tracing, self.metrics)
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self._service, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        await server.start()
        await self.metrics.start(loop, config.host, config.metrics_port)
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        logger.info(
            "%s worker %s serving on %s", config.role.value, config.worker_id, self.endpoint
        )
        return self.endpoint

    async def stop(self) -> None:
        """Finish in-flight streams (up to the drain timeout), then free everything."""
        if self._server is not None:
            await self._server.stop(self.config.drain_timeout_s)
        await self.metrics.stop()
        if self._service is not None:
            await self._service.close()
        if self._kv_client is not None:
            await self._kv_client.close()
        if self._loop is not None:
            self._loop.stop()
        self.tracing.shutdown()
