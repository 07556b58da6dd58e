"""The router's view of the workers: endpoints, gRPC stubs, readiness, pair choice.

The goodput policy (`router.policy`) chooses the pair; `pair()` turns its choice into stubs.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.engine.config import parse_enum
from tandem.proto.cluster_auth import ClusterAuth, internal_channel
from tandem.proto.server_options import GRPC_OPTIONS
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc
from tandem.worker.config import WorkerRole

logger = logging.getLogger(__name__)

# How long a removed worker's channel stays open for the calls still ending on it.
RETIRED_CHANNEL_GRACE_S = 10.0


@dataclass(frozen=True)
class WorkerEndpoint:
    worker_id: str
    role: WorkerRole
    # host:port of the worker's gRPC server
    endpoint: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", parse_enum(WorkerRole, self.role, "role"))


@dataclass
class WorkerPair:
    """Where one request runs: `prefill` is None when the decode worker prefills itself."""

    prefill: WorkerEndpoint | None
    prefill_stub: worker_pb2_grpc.PrefillWorkerStub | None
    decode: WorkerEndpoint
    decode_stub: worker_pb2_grpc.DecodeWorkerStub

    def prefill_target(self) -> tuple[WorkerEndpoint, worker_pb2_grpc.PrefillWorkerStub]:
        """The prefill worker and its stub; ValueError for a local-prefill pair."""
        if self.prefill is None or self.prefill_stub is None:
            raise ValueError(f"{self.decode.worker_id} prefills locally: no prefill worker")
        return self.prefill, self.prefill_stub


class WorkerPool:
    """Owns one gRPC channel per worker; closed by `close()`.

    Membership may change while serving (`add` / `remove`). A removed worker's channel
    stays open for `RETIRED_CHANNEL_GRACE_S` so the calls still ending on it (a release,
    a cancelled stream) finish cleanly, then closes.
    """

    def __init__(self, workers: list[WorkerEndpoint], auth: ClusterAuth | None = None) -> None:
        """`auth`: the cluster token (and TLS) every call to a worker carries."""
        self.auth = auth or ClusterAuth()
        self._endpoints: dict[str, WorkerEndpoint] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closers: set[asyncio.Task] = set()
        decode = [w for w in workers if w.role is not WorkerRole.PREFILL]
        if not decode:
            raise ValueError("the cluster needs at least one decode or colocated worker")
        for worker in workers:
            self.add(worker)

    @property
    def prefill(self) -> list[WorkerEndpoint]:
        return [w for w in self._endpoints.values() if w.role is WorkerRole.PREFILL]

    @property
    def decode(self) -> list[WorkerEndpoint]:
        return [w for w in self._endpoints.values() if w.role is not WorkerRole.PREFILL]

    def get(self, worker_id: str) -> WorkerEndpoint | None:
        return self._endpoints.get(worker_id)

    def add(self, worker: WorkerEndpoint) -> None:
        """Open a channel to a new worker; ValueError if it cannot join these pools."""
        if worker.worker_id in self._endpoints:
            raise ValueError(f"worker {worker.worker_id} is already in the pool")
        roles = {w.role for w in self._endpoints.values()} | {worker.role}
        if WorkerRole.PREFILL in roles and WorkerRole.COLOCATED in roles:
            raise ValueError("prefill workers pair with decode workers, not colocated ones")
        self._endpoints[worker.worker_id] = worker
        self._channels[worker.worker_id] = self._open_channel(worker)

    def _open_channel(self, worker: WorkerEndpoint) -> grpc.aio.Channel:
        """A channel to one worker (with the cluster token): the one way to open them.
        Called on the event loop that will use it (grpc.aio binds interceptors to it)."""
        return internal_channel(worker.endpoint, self.auth, options=GRPC_OPTIONS)

    def remove(self, worker_id: str) -> None:
        """Forget a worker; its channel closes after a grace period (no-op if unknown)."""
        self._endpoints.pop(worker_id, None)
        channel = self._channels.pop(worker_id, None)
        if channel is None:
            return
        task = asyncio.get_running_loop().create_task(self._close_later(channel))
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)

    @staticmethod
    async def _close_later(channel: grpc.aio.Channel) -> None:
        try:
            await asyncio.sleep(RETIRED_CHANNEL_GRACE_S)
        finally:
            await channel.close()

    @property
    def workers(self) -> list[WorkerEndpoint]:
        return [*self.prefill, *self.decode]

    def pair(self, prefill_id: str | None, decode_id: str) -> WorkerPair:
        """The stubs of the workers a placement chose (prefill None = local prefill)."""
        by_id = self._endpoints
        prefill = by_id[prefill_id] if prefill_id is not None else None
        decode = by_id[decode_id]
        return WorkerPair(
            prefill=prefill,
            prefill_stub=self.prefill_stub(prefill) if prefill else None,
            decode=decode,
            decode_stub=self.decode_stub(decode),
        )

    def prefill_stub(self, worker: WorkerEndpoint) -> worker_pb2_grpc.PrefillWorkerStub:
        return worker_pb2_grpc.PrefillWorkerStub(self._channels[worker.worker_id])

    def decode_stub(self, worker: WorkerEndpoint) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self._channels[worker.worker_id])

    async def any_serving(self, workers: list[WorkerEndpoint], timeout_s: float) -> bool:
        """True as soon as one of `workers` answers its gRPC health check SERVING (a
        frozen one does not hold up the answer); False when none does within
        `timeout_s`."""
        checks = [asyncio.ensure_future(self._serving(w, timeout_s)) for w in workers]
        try:
            for check in asyncio.as_completed(checks):
                if await check:
                    return True
            return False
        finally:
            for check in checks:
                check.cancel()
            await asyncio.gather(*checks, return_exceptions=True)

    async def _serving(self, worker: WorkerEndpoint, timeout_s: float) -> bool:
        stub = health_pb2_grpc.HealthStub(self._channels[worker.worker_id])
        try:
            # types-grpcio-health-checking declares no methods on HealthStub.
            reply = await stub.Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def worker_stats(self, worker: WorkerEndpoint, timeout_s: float) -> pb.StatsResponse:
        if worker.role is WorkerRole.PREFILL:
            return await self.prefill_stub(worker).Stats(pb.StatsRequest(), timeout=timeout_s)
        return await self.decode_stub(worker).Stats(pb.StatsRequest(), timeout=timeout_s)

    async def stats(self, timeout_s: float) -> dict[str, pb.StatsResponse]:
        """Every worker's `Stats`, keyed by worker id."""
        workers = self.workers
        replies = await asyncio.gather(*(self.worker_stats(w, timeout_s) for w in workers))
        return {w.worker_id: r for w, r in zip(workers, replies, strict=True)}

    async def close(self) -> None:
        for task in list(self._closers):
            task.cancel()  # closes its channel now
        if self._closers:
            await asyncio.wait(self._closers, timeout=RETIRED_CHANNEL_GRACE_S)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
