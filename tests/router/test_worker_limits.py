"""The router learns KV block size and max model length from the workers' Stats, and
refuses to serve workers that disagree."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.decode_worker.server import DecodeWorker
from tandem.engine.config import EngineConfig
from tandem.prefill_worker.server import PrefillWorker
from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.router.config import RouterConfig
from tandem.router.policy_runtime import WorkerLimits, worker_limits
from tandem.router.server import Router
from tandem.router.worker_pool import WorkerEndpoint
from tandem.worker.config import WorkerConfig, WorkerRole
from tests.helpers.grpc_calls import public_channel
from tests.helpers.inproc_cluster import InprocCluster
from tests.helpers.kv_budget import TEST_KV_CACHE_BYTES

pytestmark = pytest.mark.timeout(300)

ROLES = {"p0": WorkerRole.PREFILL, "d0": WorkerRole.DECODE}


def stats(role: int, block_size: int = 16, max_model_len: int = 1024) -> pb.StatsResponse:
    return pb.StatsResponse(role=role, block_size=block_size, max_model_len=max_model_len)


def test_agreeing_workers_give_the_limits():
    replies = {"p0": stats(pb.WORKER_ROLE_PREFILL), "d0": stats(pb.WORKER_ROLE_DECODE)}
    assert worker_limits(replies, ROLES) == WorkerLimits(block_size=16, max_model_len=1024)


@pytest.mark.parametrize(
    ("replies", "message"),
    [
        (
            {"p0": stats(pb.WORKER_ROLE_PREFILL, 16), "d0": stats(pb.WORKER_ROLE_DECODE, 32)},
            r"workers disagree on block_size \(d0=32, p0=16\)",
        ),
        (
            {
                "p0": stats(pb.WORKER_ROLE_PREFILL, max_model_len=512),
                "d0": stats(pb.WORKER_ROLE_DECODE, max_model_len=1024),
            },
            r"workers disagree on max_model_len \(d0=1024, p0=512\)",
        ),
        (
            {"p0": stats(pb.WORKER_ROLE_PREFILL, 0), "d0": stats(pb.WORKER_ROLE_DECODE, 0)},
            "workers d0, p0 report no block_size",
        ),
        (
            {"p0": stats(pb.WORKER_ROLE_DECODE), "d0": stats(pb.WORKER_ROLE_DECODE)},
            "worker p0 reports role decode, the router expects prefill",
        ),
    ],
)
def test_workers_that_disagree_are_refused(replies, message):
    with pytest.raises(ValueError, match=message):
        worker_limits(replies, ROLES)


def test_router_start_refuses_workers_with_different_block_sizes(tiny_model_dir):
    async def scenario() -> None:
        servers = []
        workers = []
        try:
            for worker_id, role, cls, block_size in (
                ("p0", WorkerRole.PREFILL, PrefillWorker, 16),
                ("d0", WorkerRole.DECODE, DecodeWorker, 32),
            ):
                engine = EngineConfig(
                    model=str(tiny_model_dir),
                    mode=role.engine_mode,
                    num_threads=1,
                    max_model_len=1024,
                    block_size=block_size,
                    kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
                )
                server = cls(WorkerConfig(worker_id=worker_id, role=role, engine=engine))
                servers.append(server)
                workers.append(WorkerEndpoint(worker_id, role, await server.start()))
            config = RouterConfig(
                model_dir=str(tiny_model_dir), grpc_port=0, http_port=0, warmup_profile=False
            )
            router = Router(config, workers)
            try:
                with pytest.raises(ValueError, match="workers disagree on block_size"):
                    await router.start()
            finally:
                await router.stop()
        finally:
            for server in reversed(servers):
                await server.stop()

    asyncio.run(scenario())


def test_router_checks_prompts_against_the_workers_max_model_len(tiny_model_dir):
    engine_config = EngineConfig(
        model=str(tiny_model_dir),
        num_threads=1,
        max_model_len=256,
        kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
    )
    cluster = InprocCluster(str(tiny_model_dir), engine_config=engine_config)
    cluster.start()

    async def generate(prompt_len: int, max_tokens: int) -> grpc.StatusCode:
        async with public_channel(cluster.grpc_endpoint) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = gen_pb.GenerateRequest(
                prompt_token_ids=[5] * prompt_len, max_tokens=max_tokens, temperature=0.0
            )
            try:
                async for _ in stub.Generate(request, timeout=60):
                    pass
            except grpc.aio.AioRpcError as exc:
                assert "maximum context length is 256 tokens" in exc.details()
                return exc.code()
            return grpc.StatusCode.OK

    try:
        runtime = cluster.router.policy_runtime
        assert runtime.limits == WorkerLimits(block_size=16, max_model_len=256, dtype="float32")
        assert cluster.run(generate(250, 6)) == grpc.StatusCode.OK
        assert cluster.run(generate(250, 7)) == grpc.StatusCode.INVALID_ARGUMENT
        # max_tokens left out (0): the default 16, capped to the room the prompt leaves
        # (as /v1/completions does); a prompt with no room is still refused.
        assert cluster.run(generate(254, 0)) == grpc.StatusCode.OK
        assert cluster.run(generate(256, 0)) == grpc.StatusCode.INVALID_ARGUMENT
        cluster.assert_idle()
    finally:
        cluster.stop()


def test_workers_must_agree_on_their_dtype():
    replies = {"p0": stats(pb.WORKER_ROLE_PREFILL), "d0": stats(pb.WORKER_ROLE_DECODE)}
    replies["p0"].dtype, replies["d0"].dtype = "bfloat16", "bfloat16"
    assert worker_limits(replies, ROLES).dtype == "bfloat16"
    replies["d0"].dtype = "float32"
    with pytest.raises(ValueError, match=r"disagree on dtype \(d0=float32, p0=bfloat16\)"):
        worker_limits(replies, ROLES)
