"""A client that cancels mid-stream frees every worker's resources at once: within 0.3 s,
where the rest of its generation (~900 tokens of the tiny model: ~0.8 s on the CPUs this
runs on) would keep the decode worker busy for longer."""

from __future__ import annotations

import grpc
import pytest

from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tests.helpers.grpc_calls import public_channel
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)

IDLE_WITHIN_S = 0.3


async def cancel_after(endpoint: str, prompt: list[int], num_messages: int) -> int:
    async with public_channel(endpoint) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = gen_pb.GenerateRequest(
            prompt_token_ids=prompt, max_tokens=900, temperature=0.0, ignore_eos=True
        )
        call = stub.Generate(request, timeout=60)
        received = 0
        async for _ in call:
            received += 1
            if received == num_messages:
                call.cancel()
                break
        return received


@pytest.mark.parametrize("num_messages", [1, 2, 10])
def test_grpc_cancel_mid_stream_frees_workers(cluster, num_messages):
    prompt = make_prompts(2048, (100,), seed=51)[0]
    received = cluster.run(cancel_after(cluster.grpc_endpoint, prompt, num_messages))
    assert received == num_messages
    cluster.assert_idle(timeout_s=IDLE_WITHIN_S)


def test_grpc_deadline_expiry_frees_workers(cluster):
    async def scenario() -> grpc.StatusCode:
        async with public_channel(cluster.grpc_endpoint) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = gen_pb.GenerateRequest(
                prompt_token_ids=make_prompts(2048, (60,), seed=52)[0],
                max_tokens=900,
                temperature=0.0,
                ignore_eos=True,
            )
            try:
                async for _ in stub.Generate(request, timeout=0.2):
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    assert cluster.run(scenario()) is grpc.StatusCode.DEADLINE_EXCEEDED
    cluster.assert_idle(timeout_s=IDLE_WITHIN_S)
