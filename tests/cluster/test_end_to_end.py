"""The real cluster (Ray actors, gRPC, TCP KV transfer, separate worker processes).

16 concurrent `Generate` streams of mixed prompt lengths must equal `transformers`
greedy generation token for token, for 1 prefill + 1 decode, 2 colocated workers,
and 2 prefill + 2 decode; afterwards every worker is idle. Every process of the
cluster (router, workers, Ray's own) listens on loopback only.
"""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
import ray

from tandem.cluster.config import ClusterConfig, PoolsConfig
from tandem.cluster.launcher import LocalCluster
from tandem.cluster.ray_start import start_local_ray
from tandem.engine.config import EngineConfig, default_device
from tandem.router.config import RouterConfig
from tests.helpers.grpc_calls import assert_workers_idle, generate_tokens
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.kv_budget import TEST_KV_CACHE_BYTES
from tests.helpers.listeners import non_loopback_listeners
from tests.helpers.prompts import make_prompts

MAX_TOKENS = 12
PROMPT_LENS = (1, 4, 9, 16, 17, 31, 48, 64, 100, 129, 150, 200, 257, 300, 400, 511)

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray instance for the module (clusters come and go on it)."""
    start_local_ray(num_cpus=8)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(2048, PROMPT_LENS, seed=11)


@pytest.fixture(scope="module")
def expected(tiny_model_dir, prompts) -> list[list[int]]:
    return hf_greedy(tiny_model_dir, prompts, MAX_TOKENS)


def run_cluster_check(model_dir, prompts, expected, pools: PoolsConfig) -> None:
    async def scenario() -> None:
        config = ClusterConfig(
            model_dir=str(model_dir),
            pools=pools,
            engine=EngineConfig(
                model=str(model_dir),
                device=default_device(),
                num_threads=1,
                max_num_batched_tokens=256,
                max_model_len=1024,
                kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
            ),
            router=RouterConfig(model_dir=str(model_dir), grpc_port=0, http_port=0),
        )
        cluster = LocalCluster(config)
        try:
            await cluster.start()
            router = cluster.router
            health = await asyncio.to_thread(_http_status, f"{router.http_endpoint}/health")
            assert health == 200
            assert non_loopback_listeners() == []
            outputs = await generate_tokens(router.grpc_endpoint, prompts, MAX_TOKENS)
            for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
                assert got == want, f"prompt {i} ({len(prompts[i])} tokens) diverged"
            workers = [(w.endpoint, w.role) for w in cluster.workers]
            num_prefill = sum(w.role == "prefill" for w in cluster.workers)
            await assert_workers_idle(workers, max_channels=num_prefill)
        finally:
            await cluster.stop()

    asyncio.run(scenario())


def _http_status(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.status


def test_one_prefill_one_decode(ray_session, tiny_model_dir, prompts, expected):
    run_cluster_check(tiny_model_dir, prompts, expected, PoolsConfig(1, 1))


def test_two_colocated(ray_session, tiny_model_dir, prompts, expected):
    run_cluster_check(tiny_model_dir, prompts, expected, PoolsConfig.colocated(2))


def test_two_prefill_two_decode(ray_session, tiny_model_dir, prompts, expected):
    run_cluster_check(tiny_model_dir, prompts, expected, PoolsConfig(2, 2))
