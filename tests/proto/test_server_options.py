"""A burst of calls larger than gRPC's default pending-call limit reaches the handlers:
with the defaults, ~240 of 2,048 concurrent streams ended CANCELLED before any handler saw
them (the router then took a healthy decode worker for dead)."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest

from tandem.proto.cluster_auth import ClusterAuth, internal_server
from tandem.proto.server_options import SERVER_OPTIONS

pytestmark = pytest.mark.timeout(120)

BURST = 2048


async def stream_once(request: bytes, context) -> None:
    await asyncio.sleep(0.5)  # every call of the burst is open at once
    yield request


async def burst_outcomes(server: grpc.aio.Server) -> Counter[str]:
    handler = grpc.unary_stream_rpc_method_handler(stream_once)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {"S": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/t.T/S")

            async def one() -> str:
                try:
                    async for _ in call(b"x", timeout=60):
                        pass
                    return "OK"
                except grpc.aio.AioRpcError as exc:
                    return exc.code().name

            return Counter(await asyncio.gather(*(one() for _ in range(BURST))))
    finally:
        await server.stop(None)


@pytest.mark.parametrize(
    "make_server",
    [
        pytest.param(lambda: internal_server(ClusterAuth()), id="worker"),
        pytest.param(lambda: grpc.aio.server(options=SERVER_OPTIONS), id="router"),
    ],
)
def test_a_burst_of_concurrent_streams_is_served_whole(make_server):
    async def scenario() -> Counter[str]:
        return await burst_outcomes(make_server())

    assert asyncio.run(scenario()) == Counter({"OK": BURST})
