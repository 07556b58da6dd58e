"""Instant fake workers and a router over them, for measuring the router's own cost."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.engine.config import DEFAULT_BLOCK_SIZE
from tandem.proto.server_options import SERVER_OPTIONS
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc
from tandem.router.config import RouterConfig
from tandem.router.server import Router
from tandem.router.worker_pool import WorkerEndpoint
from tandem.worker.config import WorkerRole
from tandem.worker.convert import WORKER_ROLES

# Token ids the fakes answer with (any id below every preset's vocabulary works).
FAKE_FIRST_TOKEN_ID = 42
_FAKE_TOKEN_ID = 43
# A pool this large never limits admission.
_FAKE_NUM_BLOCKS = 1_000_000
_LEASE_S = 30.0
_FAKE_MAX_MODEL_LEN = 4096  # reported in `Stats`; no prompt the benchmark sends comes near


def _idle_stats(worker_id: str, role: WorkerRole) -> pb.StatsResponse:
    return pb.StatsResponse(
        worker_id=worker_id, role=WORKER_ROLES[role], num_free_blocks=_FAKE_NUM_BLOCKS,
        num_blocks=_FAKE_NUM_BLOCKS, block_size=DEFAULT_BLOCK_SIZE,
        max_model_len=_FAKE_MAX_MODEL_LEN,
    )  # fmt: skip


class FakePrefillService(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.endpoint = ""  # set once the server has its port

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        handle = pb.KvHandle(
            worker_id=self.worker_id, endpoint=self.endpoint, request_id=request.request_id,
            block_ids=[0], num_tokens=len(request.prompt_token_ids), layout_fingerprint="fake",
            lease_expiry_unix_s=time.time() + _LEASE_S,
        )  # fmt: skip
        return pb.PrefillResponse(
            first_token_id=FAKE_FIRST_TOKEN_ID, first_token_text="a", kv_handle=handle,
            timings=pb.Timings(compute_s=1e-4),
        )  # fmt: skip

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=True)

    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        return _idle_stats(self.worker_id, WorkerRole.PREFILL)


class FakeDecodeService(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id

    async def Decode(self, request: pb.DecodeRequest, context) -> AsyncIterator[pb.DecodeResponse]:
        # The first token came from the prefill; never pull the (nonexistent) KV.
        num_tokens = max(1, request.params.max_tokens - 1)
        yield pb.DecodeResponse(
            token_ids=[_FAKE_TOKEN_ID] * num_tokens, text="b" * num_tokens,
            finish_reason=pb.FINISH_REASON_LENGTH, num_prompt_tokens=len(request.prompt_token_ids),
            timings=pb.Timings(compute_s=1e-4),
        )  # fmt: skip

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=False)

    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        return _idle_stats(self.worker_id, WorkerRole.DECODE)


async def _start_server(
    add_service: Callable[[grpc.aio.Server], None], port: int
) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_service(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, f"127.0.0.1:{port}"


async def serve(args: argparse.Namespace) -> None:
    """Serve the fake workers (`workers`) or a router over them (`router`) until SIGTERM
    or SIGINT (the harness stops its processes with these)."""
    servers: list[grpc.aio.Server] = []
    router: Router | None = None
    if args.role == "workers":
        prefill = FakePrefillService("prefill-0")
        decode = FakeDecodeService("decode-0")
        server, prefill.endpoint = await _start_server(
            lambda s: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(prefill, s),
            args.prefill_port,
        )
        servers.append(server)
        server, _ = await _start_server(
            lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(decode, s),
            args.decode_port,
        )
        servers.append(server)
    else:
        config = RouterConfig(
            model_dir=args.model, grpc_port=args.grpc_port, http_port=args.http_port,
            max_local_prefill_tokens=0,
        )  # fmt: skip
        workers = [
            WorkerEndpoint("prefill-0", WorkerRole.PREFILL, f"127.0.0.1:{args.prefill_port}"),
            WorkerEndpoint("decode-0", WorkerRole.DECODE, f"127.0.0.1:{args.decode_port}"),
        ]
        router = Router(config, workers)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        if router is not None:
            await router.start()
        await stop.wait()
    finally:
        if router is not None:
            await router.stop()
        for server in servers:
            await server.stop(1.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("role", choices=("workers", "router"))
    parser.add_argument("--prefill-port", type=int, required=True)
    parser.add_argument("--decode-port", type=int, required=True)
    parser.add_argument("--model", default="models/tandem-tiny", help="router: tokenizer")
    parser.add_argument("--grpc-port", type=int, default=0, help="router: public gRPC port")
    parser.add_argument("--http-port", type=int, default=0, help="router: HTTP port")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
