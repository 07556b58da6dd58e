"""The Ray actor that hosts one worker's gRPC server (one actor per worker process)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import ray

from tandem.worker.config import WorkerConfig, WorkerRole

if TYPE_CHECKING:
    from tandem.decode_worker.server import DecodeWorker
    from tandem.prefill_worker.server import PrefillWorker

logger = logging.getLogger(__name__)


class WorkerActor:
    """Async actor: its event loop runs the worker's grpc.aio server for its lifetime."""

    def __init__(self, config: WorkerConfig) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
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

    async def stop(self) -> None:
        if self.worker is not None:
            await self.worker.stop()
            self.worker = None

    def pid(self) -> int:
        return os.getpid()


# Applied as a call, not a decorator, so mypy sees Ray's typed `ActorClass` (with
# `.options` / `.remote`) rather than the plain class.
RemoteWorkerActor = ray.remote(WorkerActor)
