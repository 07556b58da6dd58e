"""`tandem serve`'s config on real Ray: the generated token reaches the worker processes
through their configs, the router serves with it, and a call without it is refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.cluster.cli import build_parser, cluster_config_from_args
from tandem.cluster.launcher import LocalCluster
from tandem.proto.cluster_auth import TOKEN_ENV, TOKEN_FILE_ENV
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc
from tandem.worker.config import WorkerRole
from tests.helpers.grpc_calls import assert_workers_idle, generate_tokens, worker_stats
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.kv_budget import TEST_KV_CACHE_FLAG
from tests.helpers.prompts import make_prompts

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]
MAX_TOKENS = 8


async def _stats_code(endpoint: str, role: WorkerRole) -> grpc.StatusCode | None:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = (
            worker_pb2_grpc.PrefillWorkerStub(channel)
            if role is WorkerRole.PREFILL
            else worker_pb2_grpc.DecodeWorkerStub(channel)
        )
        try:
            await stub.Stats(pb.StatsRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return None


def test_serve_secures_its_ray_workers_with_a_generated_token(tiny_model_dir, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    args = build_parser().parse_args(
        ["serve", "--model", str(tiny_model_dir), "--device", "cpu", "--threads", "1",
         "--dtype", "float32", "--max-model-len", "1024", "--grpc-port", "0", "--http-port", "0",
         *TEST_KV_CACHE_FLAG]
    )  # fmt: skip
    config = cluster_config_from_args(args)
    config.router.warmup_profile = False  # a few seconds of probes this test does not need
    auth = config.worker.cluster_auth
    assert auth.requires_token
    prompts = make_prompts(2048, (20, 60, 130), seed=3)
    expected = hf_greedy(tiny_model_dir, prompts, MAX_TOKENS)

    async def scenario() -> None:
        cluster = LocalCluster(config)
        try:
            await cluster.start()
            got = await generate_tokens(cluster.router.grpc_endpoint, prompts, MAX_TOKENS)
            assert got == expected
            for worker in cluster.workers:
                code = await _stats_code(worker.endpoint, worker.role)
                assert code == grpc.StatusCode.UNAUTHENTICATED, (worker.worker_id, code)
            decode = next(w for w in cluster.workers if w.role is WorkerRole.DECODE)
            stats = await worker_stats(decode.endpoint, "decode", auth)
            assert stats.num_kv_recomputes == 0  # every pull passed the TCP handshake
            workers = [(w.endpoint, w.role) for w in cluster.workers]
            await assert_workers_idle(workers, max_channels=1, timeout_s=10, auth=auth)
        finally:
            await cluster.stop()

    asyncio.run(scenario())
