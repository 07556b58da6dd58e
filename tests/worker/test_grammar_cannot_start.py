"""A constrained request whose grammar does not compile in time: both workers answer
RESOURCE_EXHAUSTED naming why (the router answers 429 with Retry-After). Before, the
prefill worker answered INTERNAL "was aborted" (the router migrated it as a worker
failure) and the decode worker ended the stream `abort` with no token, which reached
the client as 200 with empty text."""

from __future__ import annotations

import asyncio
import concurrent.futures

import grpc
import pytest

from tandem.decode_worker.server import DecodeWorker
from tandem.engine.config import EngineConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured.spec import GuidedDecoding
from tandem.prefill_worker.server import PrefillWorker
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc
from tandem.worker.config import WorkerConfig, WorkerRole
from tandem.worker.convert import sampling_params_to_proto
from tests.helpers.kv_budget import TEST_KV_CACHE_BYTES

pytestmark = pytest.mark.timeout(120)

TIMEOUT_S = 0.2


async def call_with_a_grammar_that_never_compiles(
    role: WorkerRole, model_dir: str
) -> grpc.aio.AioRpcError:
    engine = EngineConfig(
        model=model_dir, mode=role.engine_mode, num_threads=1, max_model_len=256,
        kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
    )  # fmt: skip
    cls = PrefillWorker if role is WorkerRole.PREFILL else DecodeWorker
    worker = cls(WorkerConfig(worker_id=f"{role.value}-0", role=role, engine=engine))
    endpoint = await worker.start()
    try:
        # Before any request: its compilation never ends, and the wait for it is short.
        structured = worker.host.loop.engine.structured
        structured.compile_timeout_s = TIMEOUT_S
        structured.cache.get = lambda guided: concurrent.futures.Future()
        params = sampling_params_to_proto(
            SamplingParams(max_tokens=4, structured=GuidedDecoding.choice(["yes", "no"]))
        )
        async with grpc.aio.insecure_channel(endpoint) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                if role is WorkerRole.PREFILL:
                    request = pb.PrefillRequest(
                        request_id="r1", prompt_token_ids=[1, 2, 3], params=params
                    )
                    await worker_pb2_grpc.PrefillWorkerStub(channel).Prefill(request, timeout=30)
                else:
                    request = pb.DecodeRequest(request_id="r1", prompt_token_ids=[1, 2, 3],
                                               params=params, local_prefill=True)  # fmt: skip
                    async for _ in worker_pb2_grpc.DecodeWorkerStub(channel).Decode(
                        request, timeout=30
                    ):
                        pass
        # Nothing left behind: the request is gone from the engine.
        assert await worker.host.loop.call(lambda engine: engine.is_idle())
        return info.value
    finally:
        await worker.stop()


@pytest.mark.parametrize("role", [WorkerRole.PREFILL, WorkerRole.DECODE])
def test_a_grammar_not_compiled_in_time_is_resource_exhausted(role, tiny_model_dir):
    error = asyncio.run(call_with_a_grammar_that_never_compiles(role, str(tiny_model_dir)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert f"r1 cannot start: grammar not compiled within {TIMEOUT_S}" in error.details()
