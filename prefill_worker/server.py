"""A prefill worker process: engine thread + gRPC server (PrefillWorker, KvTransfer, health)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from tandem.engine.kv_pins import PinnedBlocks
from tandem.kv_transfer.blocks import CacheBlocks
from tandem.kv_transfer.layout import KvLayout
from tandem.kv_transfer.service import KvTransferService
from tandem.prefill_worker.service import PrefillService
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc
from tandem.telemetry.tracing import Tracing
from tandem.worker.config import WorkerConfig, WorkerRole
from tandem.worker.host import WorkerHost
from tandem.worker.metrics import WorkerMetrics


def serve_held_kv(acquire: Callable[[str], PinnedBlocks], req_id: str) -> CacheBlocks:
    """A pull's source: the request's held blocks, sent straight from the paged cache.

    `acquire` is `Engine.acquire_held_kv`, called on a transfer thread without waiting
    for the engine thread: the blocks stay pinned until the transfer calls `done()`, so
    a release, lease expiry or prefix-cache eviction during the send cannot reuse them.
    (The KV transfer benchmark serves through this function too.)"""
    pinned = acquire(req_id)
    return CacheBlocks(pinned.kv_cache, pinned.block_ids, on_done=pinned.unpin)


class PrefillWorker:
    """Owns the worker host (engine, gRPC server, metrics) and the KV transfer service."""

    def __init__(
        self,
        config: WorkerConfig,
        tracing: Tracing | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock` times the KV leases of prefilled requests (see `Engine`)."""
        if config.role is not WorkerRole.PREFILL:
            raise ValueError(f"PrefillWorker needs role prefill, got {config.role.value}")
        self.config = config
        self.host = WorkerHost(config, tracing, clock)
        self._transfer: KvTransferService | None = None

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
        self._transfer = KvTransferService(
            layout,
            read_blocks=functools.partial(serve_held_kv, loop.engine.acquire_held_kv),
            host=config.host,
            auth=config.cluster_auth,
            on_refused=functools.partial(self.host.metrics.refused, "kv_data"),
            # Shared with decode workers on this node by CUDA IPC (a CUDA cache only).
            kv_cache=loop.engine.runner.kv_caches,
        )
        service = PrefillService(
            config, loop, layout, self.host.endpoint, self._transfer.stats, self.host.tracing
        )
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(service, self.host.server)
        worker_pb2_grpc.add_KvTransferServicer_to_server(self._transfer, self.host.server)
        self._transfer.start()
        return await self.host.serve()

    async def stop(self) -> None:
        """Finish in-flight calls (up to the drain timeout), then free everything."""
        await self.host.close_server()
        if self._transfer is not None:
            await self._transfer.stop()
        self.host.close()
