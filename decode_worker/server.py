"""A decode (or colocated) worker process: engine thread + gRPC server (DecodeWorker, health)."""

from __future__ import annotations

from tandem.decode_worker.service import DecodeService
from tandem.kv_transfer.client import KvTransferClient
from tandem.kv_transfer.layout import KvLayout
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc
from tandem.telemetry.tracing import Tracing
from tandem.worker.config import WorkerConfig, WorkerRole
from tandem.worker.host import WorkerHost
from tandem.worker.metrics import WorkerMetrics


class DecodeWorker:
    """Owns the worker host (engine, gRPC server, metrics) and the KV transfer client."""

    def __init__(self, config: WorkerConfig, tracing: Tracing | None = None) -> None:
        if config.role not in (WorkerRole.DECODE, WorkerRole.COLOCATED):
            raise ValueError(
                f"DecodeWorker needs role decode or colocated, got {config.role.value}"
            )
        self.config = config
        self.host = WorkerHost(config, tracing)
        self._kv_client: KvTransferClient | None = None
        self._service: DecodeService | None = None

    @property
    def endpoint(self) -> str:
        return self.host.endpoint

    @property
    def metrics(self) -> WorkerMetrics:
        return self.host.metrics

    async def start(self) -> str:
        """Load the model, start serving; returns the gRPC endpoint host:port."""
        config = self.config
        loop = await self.host.open()
        layout = KvLayout.from_engine_config(config.engine)
        self._kv_client = KvTransferClient(
            layout,
            config.worker_id,
            backend=config.kv_backend,
            # Places this worker on its GPU for the backend choice (and NCCL's buffers).
            device=config.engine.device if config.engine.device.startswith("cuda") else None,
            timeout_s=config.pull_timeout_s,
            auth=config.cluster_auth,
        )
        self._service = DecodeService(
            config, loop, self._kv_client, self.host.tracing, self.host.metrics
        )
        worker_pb2_grpc.add_DecodeWorkerServicer_to_server(self._service, self.host.server)
        return await self.host.serve()

    async def stop(self) -> None:
        """Finish in-flight streams (up to the drain timeout), then free everything."""
        await self.host.close_server()
        if self._service is not None:
            await self._service.close()
        if self._kv_client is not None:
            await self._kv_client.close()
        self.host.close()
