"""Prefill and decode workers in this process, over real gRPC and TCP KV transfer.

Covers what a live cluster cannot stage deterministically: a prefill worker that dies
between prefill and pull (the decode worker must recompute, token-equal), and a lease
that expires unpulled.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.decode_worker.server import DecodeWorker
from tandem.engine.config import EngineConfig
from tandem.prefill_worker.server import PrefillWorker
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc
from tandem.worker.config import WorkerConfig, WorkerRole, WorkerSettings
from tests.helpers.clock import FakeClock
from tests.helpers.grpc_calls import assert_workers_idle, worker_stats
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.kv_budget import TEST_KV_CACHE_BYTES
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 10


def worker_config(model_dir, worker_id: str, role: WorkerRole, **engine) -> WorkerConfig:
    engine_config = EngineConfig(
        model=str(model_dir),
        mode=role.engine_mode,
        max_model_len=1024,
        num_threads=1,
        kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
        **engine,
    )
    settings = WorkerSettings(pull_timeout_s=5.0)
    return WorkerConfig(worker_id=worker_id, role=role, engine=engine_config, settings=settings)


def greedy(max_tokens: int = MAX_TOKENS) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0)


async def decode_all(stub, request: pb.DecodeRequest) -> tuple[list[int], bool]:
    tokens, recomputed = [], False
    async for msg in stub.Decode(request, timeout=60):
        tokens += msg.token_ids
        recomputed |= msg.kv_recomputed
    return tokens, recomputed


def test_pull_from_dead_prefill_worker_is_recomputed(tiny_model_dir):
    prompt = make_prompts(2048, (150,), seed=21)[0]
    [expected] = hf_greedy(tiny_model_dir, [prompt], MAX_TOKENS)

    async def scenario() -> None:
        prefill = PrefillWorker(worker_config(tiny_model_dir, "p0", WorkerRole.PREFILL))
        decode = DecodeWorker(worker_config(tiny_model_dir, "d0", WorkerRole.DECODE))
        p_endpoint = await prefill.start()
        d_endpoint = await decode.start()
        try:
            async with grpc.aio.insecure_channel(p_endpoint) as channel:
                stub = worker_pb2_grpc.PrefillWorkerStub(channel)
                request = pb.PrefillRequest(
                    request_id="r1", prompt_token_ids=prompt, params=greedy()
                )
                reply = await stub.Prefill(request, timeout=60)
            assert reply.HasField("kv_handle") and reply.first_token_id == expected[0]
            await prefill.stop()  # dies between prefill and pull
            async with grpc.aio.insecure_channel(d_endpoint) as channel:
                stub = worker_pb2_grpc.DecodeWorkerStub(channel)
                request = pb.DecodeRequest(
                    request_id="r1",
                    prompt_token_ids=prompt,
                    params=greedy(),
                    kv_handle=reply.kv_handle,
                    first_token_id=reply.first_token_id,
                )
                tokens, recomputed = await decode_all(stub, request)
            assert recomputed
            assert [reply.first_token_id, *tokens] == expected
            stats = await worker_stats(d_endpoint, "decode")
            assert stats.num_kv_recomputes == 1
            await assert_workers_idle([(d_endpoint, "decode")], max_channels=1)
        finally:
            await decode.stop()
            await prefill.stop()

    asyncio.run(scenario())


def test_pulled_kv_matches_and_unpulled_lease_expires(tiny_model_dir):
    prompts = make_prompts(2048, (40, 200), seed=22)
    expected = hf_greedy(tiny_model_dir, prompts, MAX_TOKENS)

    # The prefill engine's leases run on this clock: the test moves it past the lease.
    clock = FakeClock()

    async def scenario() -> None:
        prefill = PrefillWorker(
            worker_config(tiny_model_dir, "p0", WorkerRole.PREFILL, kv_lease_s=60.0), clock=clock
        )
        decode = DecodeWorker(worker_config(tiny_model_dir, "d0", WorkerRole.DECODE))
        p_endpoint = await prefill.start()
        d_endpoint = await decode.start()
        try:
            async with (
                grpc.aio.insecure_channel(p_endpoint) as p_channel,
                grpc.aio.insecure_channel(d_endpoint) as d_channel,
            ):
                p_stub = worker_pb2_grpc.PrefillWorkerStub(p_channel)
                d_stub = worker_pb2_grpc.DecodeWorkerStub(d_channel)
                # Pulled: the decode side's output continues the prefill's first token.
                pulled = await p_stub.Prefill(
                    pb.PrefillRequest(request_id="a", prompt_token_ids=prompts[0], params=greedy()),
                    timeout=60,
                )
                request = pb.DecodeRequest(
                    request_id="a",
                    prompt_token_ids=prompts[0],
                    params=greedy(),
                    kv_handle=pulled.kv_handle,
                    first_token_id=pulled.first_token_id,
                )
                tokens, recomputed = await decode_all(d_stub, request)
                assert not recomputed
                assert [pulled.first_token_id, *tokens] == expected[0]
                # Unpulled: the lease runs out and the blocks come back.
                await p_stub.Prefill(
                    pb.PrefillRequest(request_id="b", prompt_token_ids=prompts[1], params=greedy()),
                    timeout=60,
                )
                held = await worker_stats(p_endpoint, "prefill")
                assert held.num_held == 1 and held.num_free_blocks < held.num_blocks
                # Just before the lease ends, nothing expires ...
                clock.advance(59.0)
                expire = prefill.host.loop.call(lambda engine: engine.expire_leases(clock()))
                assert await expire == []
                # ... past it, the engine loop's next idle wake-up frees the blocks.
                clock.advance(2.0)
            await assert_workers_idle([(p_endpoint, "prefill"), (d_endpoint, "decode")], 1)
        finally:
            await decode.stop()
            await prefill.stop()

    asyncio.run(scenario())


def test_decode_worker_prefills_only_when_told_and_reports_its_limits(tiny_model_dir):
    """DECODE_ONLY is real: a plain prompt (no KvHandle, no local_prefill) is refused;
    with `local_prefill` (the router's conditional disaggregation) it is served. Stats
    carry the role as an enum plus the engine's block size and max model length."""
    prompt = make_prompts(2048, (60,), seed=23)[0]
    [expected] = hf_greedy(tiny_model_dir, [prompt], MAX_TOKENS)

    async def scenario() -> None:
        decode = DecodeWorker(worker_config(tiny_model_dir, "d0", WorkerRole.DECODE))
        endpoint = await decode.start()
        try:
            async with grpc.aio.insecure_channel(endpoint) as channel:
                stub = worker_pb2_grpc.DecodeWorkerStub(channel)
                plain = pb.DecodeRequest(request_id="r1", prompt_token_ids=prompt, params=greedy())
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await decode_all(stub, plain)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "decode-only engine" in refused.value.details()
                told = pb.DecodeRequest(
                    request_id="r2", prompt_token_ids=prompt, params=greedy(), local_prefill=True
                )
                tokens, recomputed = await decode_all(stub, told)
                assert tokens == expected and not recomputed
            stats = await worker_stats(endpoint, "decode")
            assert stats.role == pb.WORKER_ROLE_DECODE
            assert (stats.block_size, stats.max_model_len) == (16, 1024)
            await assert_workers_idle([(endpoint, "decode")], max_channels=0)
        finally:
            await decode.stop()

    asyncio.run(scenario())
