"""A gRPC client that stops reading its stream is cut after `WRITE_TIMEOUT_S` of no
progress: its stream ends with DEADLINE_EXCEEDED, and the router frees the request at
once instead of waiting on the client for as long as its connection stays open."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from tandem.proto.cluster_auth import metadata_interceptors
from tandem.proto.inference import grpc_service_pb2 as kserve_pb
from tandem.proto.inference import grpc_service_pb2_grpc as kserve_grpc
from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tandem.router import grpc_streams
from tests.helpers.grpc_calls import BEARER
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(120)

STALL_S = 0.5
# No BDP probe: the client's receive window stays 64 KiB, so a few hundred KB of
# output fill it (with the probe it grows to megabytes).
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0)]


def small_window_channel(endpoint: str) -> grpc.aio.Channel:
    """A channel to the router's public port with the test API key and a 64 KiB window."""
    return grpc.aio.insecure_channel(
        endpoint, options=SMALL_WINDOW, interceptors=metadata_interceptors(*BEARER)
    )


async def _wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.05)
    return condition()


def test_generate_stream_of_a_client_that_stops_reading_is_ended(cluster, monkeypatch, caplog):
    monkeypatch.setattr(grpc_streams, "WRITE_TIMEOUT_S", STALL_S)
    policy = cluster.router.policy_runtime.policy
    # ~900 tokens, each with 20 top logprobs: well over the 64 KiB window.
    request = gen_pb.GenerateRequest(
        prompt_token_ids=make_prompts(2048, (20,), seed=61)[0],
        max_tokens=900,
        temperature=0.0,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=20,
    )

    async def scenario() -> tuple[bool, int, grpc.StatusCode, str]:
        async with small_window_channel(cluster.grpc_endpoint) as channel:
            call = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)
            messages = call.__aiter__()
            await messages.__anext__()
            # The client reads nothing more: the router cuts it and frees the request
            # while the client still sits on its unread messages.
            freed = await _wait_until(
                lambda: "took no data" in caplog.text and policy.is_idle(), timeout_s=30
            )
            num_tokens = 0
            try:
                async for msg in messages:
                    num_tokens += len(msg.token_ids)
            except grpc.aio.AioRpcError as exc:
                return freed, num_tokens, exc.code(), exc.details() or ""
            return freed, num_tokens, grpc.StatusCode.OK, ""

    with caplog.at_level(logging.INFO, logger="tandem.router.generation_service"):
        freed, num_tokens, code, details = cluster.run(scenario())
    assert freed, "the router kept the stalled client's request"
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED, (code, num_tokens)
    assert f"took no data for {STALL_S:g} s" in details
    assert num_tokens < 899  # what was sent before the stall, then the status
    cluster.assert_idle()


def test_write_message_cuts_a_stalled_client_without_waiting_on_it():
    """A bare gRPC server: the handler ends as soon as the stall is seen (an abort would
    wait until the client reads up to its status), and the client, reading again later,
    gets every message sent before the cut, then DEADLINE_EXCEEDED."""
    ended_at: list[float] = []

    async def handler(request: bytes, context) -> None:
        try:
            for _ in range(2000):
                await grpc_streams.write_message(context, b"x" * 1000, timeout_s=STALL_S)
        except grpc_streams.ClientStalled as exc:
            grpc_streams.end_stalled(context, exc)
        finally:
            ended_at.append(time.monotonic())

    async def scenario() -> tuple[float, int, grpc.StatusCode, str]:
        server = grpc.aio.server()
        method = grpc.unary_stream_rpc_method_handler(handler)
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("t.T", {"S": method})]
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=SMALL_WINDOW) as ch:
                started = time.monotonic()
                call = ch.unary_stream("/t.T/S")(b"", timeout=30)
                messages = call.__aiter__()
                await messages.__anext__()
                await _wait_until(lambda: bool(ended_at), timeout_s=10)
                handler_s = (ended_at[0] if ended_at else time.monotonic()) - started
                received = 1
                try:
                    async for _ in messages:
                        received += 1
                except grpc.aio.AioRpcError as exc:
                    return handler_s, received, exc.code(), exc.details() or ""
                return handler_s, received, grpc.StatusCode.OK, ""
        finally:
            await server.stop(1)

    handler_s, received, code, details = asyncio.run(scenario())
    assert handler_s < STALL_S + 2.0, f"the handler waited on the client for {handler_s:.1f} s"
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "took no data" in details
    assert 1 < received < 2000


def test_kserve_stream_of_a_client_that_stops_reading_is_ended(cluster, monkeypatch, caplog):
    monkeypatch.setattr(grpc_streams, "WRITE_TIMEOUT_S", STALL_S)
    policy = cluster.router.policy_runtime.policy

    def streamed(index: int) -> kserve_pb.ModelInferRequest:
        request = kserve_pb.ModelInferRequest(
            model_name=cluster.router.config.model_name, id=f"stall-{index}"
        )
        prompt = f"request {index} of a stream whose client stops reading".encode()
        sampling = b'{"max_tokens": 900, "temperature": 0, "ignore_eos": true}'
        for name, datatype, field, value in [
            ("text_input", "BYTES", "bytes_contents", prompt),
            ("sampling_parameters", "BYTES", "bytes_contents", sampling),
            ("stream", "BOOL", "bool_contents", True),
        ]:
            tensor = request.inputs.add(name=name, datatype=datatype, shape=[1])
            getattr(tensor.contents, field).append(value)
        return request

    async def scenario() -> tuple[bool, grpc.StatusCode, str]:
        async with small_window_channel(cluster.grpc_endpoint) as channel:
            stub = kserve_grpc.GRPCInferenceServiceStub(channel)
            # Four requests of ~900 text deltas each, one response per delta.
            call = stub.ModelStreamInfer(iter([streamed(i) for i in range(4)]), timeout=60)
            responses = call.__aiter__()
            await responses.__anext__()
            freed = await _wait_until(
                lambda: "took no data" in caplog.text and policy.is_idle(), timeout_s=30
            )
            try:
                async for _ in responses:
                    pass
            except grpc.aio.AioRpcError as exc:
                return freed, exc.code(), exc.details() or ""
            return freed, grpc.StatusCode.OK, ""

    with caplog.at_level(logging.INFO, logger="tandem.router.kserve_service"):
        freed, code, details = cluster.run(scenario())
    assert freed, "the router kept the stalled client's requests"
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED, code
    assert f"took no data for {STALL_S:g} s" in details
    cluster.assert_idle()
