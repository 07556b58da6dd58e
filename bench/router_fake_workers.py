"""Instant fake workers and a router over them, for measuring the router's own cost.

`serve_fake_workers` starts a `PrefillWorker` and a `DecodeWorker` gRPC server (plus
gRPC health) that answer at once: `Prefill` returns a first token and a dummy
`KvHandle`, `Decode` streams the remaining `max_tokens - 1` tokens in one message and
finishes; nothing is computed and no KV is pulled (there is none). `Stats` reports an
idle worker with a large, free block pool, so the policy never runs out of room.
`serve_router` runs a real `Router` over them. Both are `router_procs.ServeFn`s: each
runs in its own process, so the router's core is not shared with its workers.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.proto.server_options import GRPC_OPTIONS
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc
from tandem.router.config import RouterConfig
from tandem.router.server import Router
from tandem.router.worker_pool import WorkerEndpoint

# Token ids the fakes answer with (any id below every preset's vocabulary works).
FAKE_FIRST_TOKEN_ID = 42
_FAKE_TOKEN_ID = 43
# A pool this large never limits admission.
_FAKE_NUM_BLOCKS = 1_000_000
_LEASE_S = 30.0


def _idle_stats(worker_id: str, role: str) -> pb.StatsResponse:
    return pb.StatsResponse(
        worker_id=worker_id,
        role=role,
        num_free_blocks=_FAKE_NUM_BLOCKS,
        num_blocks=_FAKE_NUM_BLOCKS,
    )


class FakePrefillService(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.endpoint = ""  # set once the server has its port

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        handle = pb.KvHandle(
            worker_id=self.worker_id,
            endpoint=self.endpoint,
            request_id=request.request_id,
            block_ids=[0],
            num_tokens=len(request.prompt_token_ids),
            layout_fingerprint="fake",
            lease_expiry_unix_s=time.time() + _LEASE_S,
        )
        return pb.PrefillResponse(
            first_token_id=FAKE_FIRST_TOKEN_ID,
            first_token_text="a",
            kv_handle=handle,
            timings=pb.Timings(compute_s=1e-4),
        )

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=True)

    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        return _idle_stats(self.worker_id, "prefill")


class FakeDecodeService(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id

    async def Decode(self, request: pb.DecodeRequest, context) -> AsyncIterator[pb.DecodeResponse]:
        # The first token came from the prefill; never pull the (nonexistent) KV.
        num_tokens = max(1, request.params.max_tokens - 1)
        yield pb.DecodeResponse(
            token_ids=[_FAKE_TOKEN_ID] * num_tokens,
            text="b" * num_tokens,
            finish_reason=pb.FINISH_REASON_LENGTH,
            num_prompt_tokens=len(request.prompt_token_ids),
            timings=pb.Timings(compute_s=1e-4),
        )

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=False)

    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        return _idle_stats(self.worker_id, "decode")


async def _start_server(
    add_service: Callable[[grpc.aio.Server], None],
) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(options=GRPC_OPTIONS)
    add_service(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, f"127.0.0.1:{port}"


async def serve_fake_workers(
    _: None = None,
) -> tuple[tuple[WorkerEndpoint, ...], Callable[[], Awaitable[None]]]:
    """One fake prefill and one fake decode worker, each its own gRPC server."""
    prefill = FakePrefillService("prefill-0")
    decode = FakeDecodeService("decode-0")
    servers: list[grpc.aio.Server] = []

    async def stop() -> None:
        for server in servers:
            await server.stop(1.0)

    try:
        server, prefill.endpoint = await _start_server(
            lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(prefill, s)
        )
        servers.append(server)
        server, decode_endpoint = await _start_server(
            lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(decode, s)
        )
        servers.append(server)
    except BaseException:
        await stop()
        raise
    workers = (
        WorkerEndpoint(prefill.worker_id, "prefill", prefill.endpoint),
        WorkerEndpoint(decode.worker_id, "decode", decode_endpoint),
    )
    return workers, stop


@dataclass(frozen=True)
class RouterArgs:
    config: RouterConfig
    workers: tuple[WorkerEndpoint, ...]


async def serve_router(args: RouterArgs) -> tuple[str, Callable[[], Awaitable[None]]]:
    """A real router over `args.workers`; hands back its public gRPC endpoint."""
    router = Router(args.config, list(args.workers))
    try:
        await router.start()
    except BaseException:
        await router.stop()
        raise
    return router.grpc_endpoint, router.stop
