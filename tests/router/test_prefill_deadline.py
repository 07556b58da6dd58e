"""A prefill that runs past the router's deadline: the router unpins its KV.

The prefill worker may have answered (its prompt's KV pinned for the decode worker's
pull) just as the deadline passed; nobody will pull it, so the router sends `Release`
(a no-op on the worker where nothing is held) rather than leave it to the 30 s lease.
A real gRPC server stands in for the prefill worker: it answers too late, and records
the releases it gets.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc
from tandem.router.attempts import Attempt, AttemptFailed, MigrationReason
from tandem.router.worker_calls import WorkerCalls
from tandem.router.worker_pool import WorkerEndpoint, WorkerPool
from tandem.telemetry.tracing import Tracing
from tandem.worker.config import WorkerRole

pytestmark = pytest.mark.timeout(60)

DEADLINE_S = 0.2


class LatePrefillWorker(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self) -> None:
        self.released: list[str] = []

    async def Prefill(self, request, context):
        await asyncio.sleep(DEADLINE_S * 3)
        return pb.PrefillResponse()

    async def Release(self, request, context):
        self.released.append(request.request_id)
        return pb.ReleaseResponse()


def test_a_prefill_past_its_deadline_is_released_and_fails_the_attempt():
    async def scenario() -> tuple[AttemptFailed, list[str]]:
        worker = LatePrefillWorker()
        server = grpc.aio.server()
        worker_pb2_grpc.add_PrefillWorkerServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        pool = WorkerPool([
            WorkerEndpoint("prefill-0", WorkerRole.PREFILL, f"127.0.0.1:{port}"),
            WorkerEndpoint("decode-0", WorkerRole.DECODE, "127.0.0.1:9"),  # never called
        ])  # fmt: skip
        tracing = Tracing("test")
        calls = WorkerCalls(policy=None, tracing=tracing, prefill_timeout_s=DEADLINE_S,  # type: ignore[arg-type]
                            request_timeout_s=10.0)  # fmt: skip
        try:
            with pytest.raises(AttemptFailed) as failed:
                await calls.prefill(
                    pool.pair("prefill-0", "decode-0"),
                    pb.PrefillRequest(request_id="req-1"),
                    tracing.start_span("request", None),
                    Attempt(("prefill-0", "decode-0")),
                )
            return failed.value, worker.released
        finally:
            await pool.close()
            await server.stop(None)

    failure, released = asyncio.run(scenario())
    assert failure.reason is MigrationReason.PREFILL_FAILED
    assert released == ["req-1"]
