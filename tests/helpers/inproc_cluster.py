"""A real cluster inside the test process: 1 prefill + 1 decode worker (or the `roles`
given) and a router, over real gRPC, TCP KV transfer and HTTP, on an asyncio loop in a
background thread (so synchronous clients such as `openai` or `tritonclient` can call it).

`tests/conftest.py` starts one with `shared_router_config` for the whole session (the
`cluster` fixture); tests that need other settings start their own, passing typed
configs (`dataclasses.replace` of `inproc_engine_config` / `inproc_router_config`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Collection, Coroutine, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import openai

from tandem.decode_worker.server import DecodeWorker
from tandem.engine.config import EngineConfig
from tandem.prefill_worker.server import PrefillWorker
from tandem.proto.cluster_auth import ClusterAuth
from tandem.router.config import RouterConfig
from tandem.router.server import Router
from tandem.router.worker_pool import WorkerEndpoint
from tandem.telemetry.tracing import Tracing
from tandem.worker.config import WorkerConfig, WorkerRole, WorkerSettings
from tests.helpers.grpc_calls import TEST_API_KEY, assert_workers_idle
from tests.helpers.kv_budget import TEST_KV_CACHE_BYTES

# The session cluster's router: every public API needs this key (gRPC clients:
# grpc_calls.public_channel), and HTTP refuses bodies over MAX_BODY_BYTES.
SHARED_API_KEY = TEST_API_KEY
SHARED_MAX_BODY_BYTES = 256 * 1024


def inproc_engine_config(model_dir: str) -> EngineConfig:
    """Both workers' engine by default (each worker sets `mode` for its role): one torch
    thread, 1024-token model length."""
    return EngineConfig(
        model=model_dir,
        num_threads=1,
        max_model_len=1024,
        kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
    )


def inproc_router_config(model_dir: str) -> RouterConfig:
    """The router by default: free ports, and no start-up profile (its probes would show
    in exact worker counts). Block size and max model length it learns from the workers."""
    return RouterConfig(model_dir=model_dir, grpc_port=0, http_port=0, warmup_profile=False)


def shared_router_config(model_dir: str) -> RouterConfig:
    """The session cluster's router: API key and body limit on top of the defaults."""
    return replace(
        inproc_router_config(model_dir),
        api_key=SHARED_API_KEY,
        max_body_bytes=SHARED_MAX_BODY_BYTES,
    )


@dataclass
class InprocCluster:
    model_dir: str
    # None = inproc_router_config(model_dir).
    router_config: RouterConfig | None = None
    # Both workers' engine; its `mode` is set per role. None = inproc_engine_config.
    engine_config: EngineConfig | None = None
    # Shared by the router and both workers (e.g. to collect every span in memory).
    tracing: Tracing | None = None
    # The cluster token (and TLS) the workers require and the router presents.
    cluster_auth: ClusterAuth = field(default_factory=ClusterAuth)
    # Worker id -> role, in start order (decode and colocated workers prefill locally).
    roles: dict[str, WorkerRole] = field(
        default_factory=lambda: {"prefill-0": WorkerRole.PREFILL, "decode-0": WorkerRole.DECODE}
    )
    router: Router | None = None
    workers: list[WorkerEndpoint] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._servers: list = []

    def run(self, coro: Coroutine, timeout_s: float = 120.0) -> Any:
        """Run a coroutine on the cluster's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def start(self) -> InprocCluster:
        self._thread.start()
        self.run(self._start(), timeout_s=300)
        return self

    async def _start(self) -> None:
        template = self.engine_config or inproc_engine_config(self.model_dir)
        for worker_id, role in self.roles.items():
            cls = PrefillWorker if role is WorkerRole.PREFILL else DecodeWorker
            engine = replace(template, mode=role.engine_mode)
            config = WorkerConfig(
                worker_id=worker_id,
                role=role,
                engine=engine,
                settings=WorkerSettings(cluster_auth=self.cluster_auth),
            )
            server = cls(config, tracing=self.tracing)
            self._servers.append(server)
            endpoint = await server.start()
            self.workers.append(WorkerEndpoint(worker_id, role, endpoint))
        router_config = self.router_config or inproc_router_config(self.model_dir)
        # The router presents the token the workers require.
        router_config = replace(router_config, cluster_auth=self.cluster_auth)
        self.router = Router(router_config, self.workers, tracing=self.tracing)
        await self.router.start()

    @property
    def worker_metrics_endpoints(self) -> dict[str, str]:
        """worker id -> its Prometheus endpoint (http://host:port)."""
        return {s.config.worker_id: s.metrics.endpoint for s in self._servers}

    @property
    def grpc_endpoint(self) -> str:
        return self.router.grpc_endpoint

    @property
    def http_endpoint(self) -> str:
        return self.router.http_endpoint

    def assert_idle(
        self, timeout_s: float = 5.0, worker_ids: Collection[str] | None = None
    ) -> None:
        """Every worker (or those named) back to idle (blocks free, nothing held, no stream
        open), and the router's policy charges no request."""
        workers = [
            (w.endpoint, w.role)
            for w in self.workers
            if worker_ids is None or w.worker_id in worker_ids
        ]
        self.run(
            assert_workers_idle(
                workers, max_channels=1, timeout_s=timeout_s, auth=self.cluster_auth
            )
        )
        policy = self.router.policy_runtime.policy
        assert policy.is_idle(), f"router policy still charges {policy.num_in_flight} requests"

    def stop(self) -> None:
        async def _stop() -> None:
            if self.router is not None:
                await self.router.stop()
            for server in reversed(self._servers):
                await server.stop()

        try:
            self.run(_stop(), timeout_s=60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()


def openai_client(http_endpoint: str, timeout_s: float = 120.0) -> Iterator[openai.OpenAI]:
    """For a fixture to `yield from`: the official `openai` client of a router's HTTP API
    (the shared cluster's API key; no retries), closed afterwards."""
    client = openai.OpenAI(
        base_url=f"{http_endpoint}/v1", api_key=SHARED_API_KEY, max_retries=0, timeout=timeout_s
    )
    try:
        yield client
    finally:
        client.close()
