"""KV transfer behind the cluster token: a pull without it is refused, on gRPC
(OpenChannel) and on the TCP data plane (the Hello), before any KV is read or sent."""

from __future__ import annotations

import asyncio
import logging
import socket

import grpc
import pytest
import torch

from tandem.kv_transfer import KvTransferClient, KvTransferError
from tandem.kv_transfer.tcp_channel import TcpChannel, split_endpoint
from tandem.kv_transfer.wire import DataReply, DataRequest, Hello, recv_message, send_message
from tandem.proto.cluster_auth import ClusterAuth, internal_channel
from tandem.proto.tandem.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.helpers.kv_transfer_harness import TINY, FakeEngine, bits, prefill_server, random_cache

pytestmark = pytest.mark.timeout(60)

AUTH = ClusterAuth(token="kv-test-token-0123456789abcdef")
OTHER = ClusterAuth(token="another-token-0123456789abcdef")
# A request id that must never show up in a refusal log line.
SECRET_REQUEST = "req-prompt-secret-7f3a"


def make_engine() -> FakeEngine:
    return FakeEngine(random_cache(TINY, 16), {SECRET_REQUEST: [1, 2, 3]})


def test_pull_with_the_cluster_token_is_bit_exact() -> None:
    engine = make_engine()

    async def run() -> None:
        async with prefill_server(TINY, engine.read_blocks, auth=AUTH) as prefill:
            client = KvTransferClient(TINY, "decode-0", auth=AUTH)
            try:
                got = await client.pull(prefill.handle(TINY, SECRET_REQUEST, [1, 2, 3]))
                assert torch_equal(got, engine.expected(SECRET_REQUEST))
                assert prefill.service.num_refused_connections == 0
            finally:
                await client.close()

    asyncio.run(run())


def torch_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((bits(a) == bits(b)).all())


@pytest.mark.parametrize("auth", [None, OTHER], ids=["no-token", "wrong-token"])
def test_pull_without_the_token_is_refused_and_logged_without_request_data(
    auth: ClusterAuth | None, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine()

    async def run() -> None:
        async with prefill_server(TINY, engine.read_blocks, auth=AUTH) as prefill:
            client = KvTransferClient(TINY, "decode-0", auth=auth)
            try:
                with pytest.raises(KvTransferError, match=r"refused.*cluster token"):
                    await client.pull(prefill.handle(TINY, SECRET_REQUEST, [1, 2, 3]))
                # Refused before a channel was registered: nothing to clean up.
                assert prefill.service.stats().num_open_channels == 0
                assert client.stats().num_open_channels == 0
            finally:
                await client.close()

    with caplog.at_level(logging.WARNING):
        asyncio.run(run())
    refusals = [r.getMessage() for r in caplog.records if "refused internal call" in r.message]
    assert refusals, caplog.text
    assert "/tandem.worker.v1.KvTransfer/OpenChannel from " in refusals[0]
    assert SECRET_REQUEST not in caplog.text
    assert AUTH.token not in caplog.text


async def _open_channel(endpoint: str) -> worker_pb2.OpenChannelResponse:
    """A channel id the legitimate way (gRPC with the token), to attack its data socket."""
    async with internal_channel(endpoint, AUTH) as channel:
        return await worker_pb2_grpc.KvTransferStub(channel).OpenChannel(
            worker_pb2.OpenChannelRequest(
                decode_worker_id="decode-0",
                layout_fingerprint=TINY.fingerprint(),
                backend=worker_pb2.KV_BACKEND_TCP,
            ),
            timeout=10,
        )


def _first_message_refused(endpoint: str, first: Hello | DataRequest) -> DataReply:
    """Connect to the data server, send `first`; the reply, after which the server must
    have closed the socket (nothing else comes)."""
    with socket.create_connection(split_endpoint(endpoint), timeout=5) as sock:
        send_message(sock, first)
        reply = recv_message(sock, 5)
        assert isinstance(reply, DataReply)
        sock.settimeout(5)
        assert sock.recv(1) == b"", "the data server kept the refused socket open"
        return reply


def test_data_connection_without_the_token_proof_is_closed_before_any_kv(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = make_engine()

    async def run() -> None:
        async with prefill_server(TINY, engine.read_blocks, auth=AUTH) as prefill:
            opened = await _open_channel(prefill.endpoint)
            attempts = [
                Hello(opened.channel_id),  # no proof
                Hello(opened.channel_id, OTHER.kv_hello_proof(opened.channel_id)),
                Hello(opened.channel_id, AUTH.kv_hello_proof("another-channel")),
                DataRequest(SECRET_REQUEST),  # straight to the data, no handshake
            ]
            for first in attempts:
                reply = await asyncio.to_thread(_first_message_refused, opened.tcp_endpoint, first)
                assert reply.status == "unauthenticated", reply
                assert reply.nbytes == 0
            assert prefill.service.num_refused_connections == len(attempts)
            # The refused sockets did not take the channel: its owner still attaches.
            channel = await asyncio.to_thread(
                TcpChannel.connect, opened.channel_id, opened.tcp_endpoint, TINY, 5.0, None, AUTH
            )
            try:
                got = await asyncio.to_thread(channel.pull, SECRET_REQUEST, 3)
                assert torch_equal(got, engine.expected(SECRET_REQUEST))
            finally:
                channel.close()

    with caplog.at_level(logging.WARNING):
        asyncio.run(run())
    refusals = [r.getMessage() for r in caplog.records if "refused KV data connection" in r.message]
    # One line for the first refusal; the rest fall in its rate-limit interval.
    assert len(refusals) == 1, refusals
    assert "from 127.0.0.1:" in refusals[0] and "no cluster token proof" in refusals[0]
    assert SECRET_REQUEST not in caplog.text


def test_open_server_accepts_a_client_with_a_token() -> None:
    """A worker without a token (in-process tests) still serves a client that has one."""
    engine = make_engine()

    async def run() -> None:
        async with prefill_server(TINY, engine.read_blocks) as prefill:
            client = KvTransferClient(TINY, "decode-0", auth=AUTH)
            try:
                got = await client.pull(prefill.handle(TINY, SECRET_REQUEST, [1, 2, 3]))
                assert torch_equal(got, engine.expected(SECRET_REQUEST))
            finally:
                await client.close()

    asyncio.run(run())


def test_unauthenticated_open_channel_is_a_grpc_status() -> None:
    engine = make_engine()

    async def run() -> None:
        async with prefill_server(TINY, engine.read_blocks, auth=AUTH) as prefill:
            async with grpc.aio.insecure_channel(prefill.endpoint) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await worker_pb2_grpc.KvTransferStub(channel).OpenChannel(
                        worker_pb2.OpenChannelRequest(layout_fingerprint=TINY.fingerprint()),
                        timeout=10,
                    )
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "cluster token" in info.value.details()
            assert prefill.service.stats().num_open_channels == 0

    asyncio.run(run())
