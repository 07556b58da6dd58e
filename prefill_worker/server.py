"""A prefill worker process: engine thread + gRPC server (PrefillWorker, KvTransfer, health)."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.engine_loop import EngineLoop
from engine.llm_engine import Engine
from engine.tracing import Tracing
from engine.worker_config import WorkerConfig, WorkerRole
from engine.worker_metrics import WorkerMetrics
from kv_transfer.layout import KvLayout
from kv_transfer.service import KvTransferService
from prefill_worker.service import PrefillService
from proto.server_options import GRPC_OPTIONS
from proto.tandem.worker.v1 import worker_pb2_grpc

logger = logging.getLogger(__name__)


class PrefillWorker:
    """Owns the engine loop, the KV transfer service and the gRPC server."""

    def __init__(self, config: WorkerConfig, tracing: Tracing | None = None) -> None:
        if config.role is not WorkerRole.PREFILL:
            raise ValueError(f"PrefillWorker needs role prefill, got {config.role.value}")
        self.config = config
        self.tracing = tracing or Tracing(f"tandem-{config.worker_id}", config.trace_exporter)
        self.endpoint = ""
        self.metrics = WorkerMetrics(config.worker_id, config.role.value)
        self._loop: EngineLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._transfer: KvTransferService | None = None

    async def start(self) -> str:
        """Load the model, start serving; returns the gRPC endpoint host:port."""
        config = self.config
        engine = await asyncio.to_thread(Engine, config.engine)
        self._loop = loop = EngineLoop(engine, name=f"engine-{config.worker_id}")
        loop.start()
        layout = KvLayout.from_engine_config(config.engine)
        self._transfer = KvTransferService(
            layout,
            read_blocks=lambda req_id: loop.call_threadsafe(lambda e: e.export_kv(req_id).blocks),
            host=config.host,
        )
        self._server = server = grpc.aio.server(options=GRPC_OPTIONS)
        port = server.add_insecure_port(f"{config.host}:{config.port}")
        self.endpoint = f"{config.host}:{port}"
        service = PrefillService(
            config, loop, layout, self.endpoint, self._transfer.stats, self.tracing
        )
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(service, server)
        worker_pb2_grpc.add_KvTransferServicer_to_server(self._transfer, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        self._transfer.start()
        await server.start()
        await self.metrics.start(loop, config.host, config.metrics_port)
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        logger.info("prefill worker %s serving on %s", config.worker_id, self.endpoint)
        return self.endpoint

    async def stop(self) -> None:
        """Finish in-flight calls (up to the drain timeout), then free everything."""
        if self._server is not None:
            await self._server.stop(self.config.drain_timeout_s)
        await self.metrics.stop()
        if self._transfer is not None:
            await self._transfer.stop()
        if self._loop is not None:
            self._loop.stop()
        self.tracing.shutdown()
