"""The router process: public gRPC server + HTTP server over one worker pool."""

from __future__ import annotations

import logging

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CONTENT_TYPE_LATEST

from tandem.proto.inference.grpc_service_pb2_grpc import add_GRPCInferenceServiceServicer_to_server
from tandem.proto.server_options import GRPC_OPTIONS
from tandem.proto.tandem.v1 import generation_pb2, generation_pb2_grpc
from tandem.router.config import RouterConfig
from tandem.router.generation_service import GenerationService
from tandem.router.http_server import make_http_app
from tandem.router.kserve_service import SERVICE_NAME as KSERVE_SERVICE_NAME
from tandem.router.kserve_service import KserveService
from tandem.router.metrics import RouterMetrics
from tandem.router.policy_runtime import PolicyRuntime
from tandem.router.request_flow import RequestFlow
from tandem.router.tokenization import PromptTokenizer
from tandem.router.worker_pool import WorkerEndpoint, WorkerPool
from tandem.telemetry.tracing import Tracing

logger = logging.getLogger(__name__)


class Router:
    """Owns the worker pool, the gRPC server and the HTTP runner."""

    def __init__(
        self, config: RouterConfig, workers: list[WorkerEndpoint], tracing: Tracing | None = None
    ) -> None:
        self.config = config
        self.tracing = tracing or Tracing("tandem-router", config.trace_exporter)
        self.pool = WorkerPool(workers, config.cluster_auth)
        self.grpc_endpoint = ""
        self.http_endpoint = ""
        self._server: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self.policy_runtime: PolicyRuntime | None = None

    async def start(self) -> None:
        config = self.config
        self.metrics = RouterMetrics(config.model_name)
        self.policy_runtime = PolicyRuntime(config, self.pool)
        policy = await self.policy_runtime.start()
        # Prompts are checked against the length the workers report, not a setting.
        tokenizer = PromptTokenizer(config.model_dir, self.policy_runtime.limits.max_model_len)
        flow = RequestFlow(
            self.pool,
            policy,
            self.policy_runtime.slo,
            self.metrics,
            self.tracing,
            config.prefill_timeout_s,
            config.request_timeout_s,
        )
        self._server = server = grpc.aio.server(options=GRPC_OPTIONS)
        generation_pb2_grpc.add_GenerationServicer_to_server(
            GenerationService(flow, tokenizer, config.model_name), server
        )
        add_GRPCInferenceServiceServicer_to_server(
            KserveService(flow, tokenizer, self.pool, config.model_name, config.probe_timeout_s),
            server,
        )
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (
                generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
                KSERVE_SERVICE_NAME,
                health.SERVICE_NAME,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        port = server.add_insecure_port(f"{config.host}:{config.grpc_port}")
        self.grpc_endpoint = f"{config.host}:{port}"
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        app = make_http_app(self.pool, flow, tokenizer, config)
        app.router.add_get("/metrics", self._metrics_handler)
        # A client that disconnects cancels its handler, which cancels its worker calls.
        self._http = web.AppRunner(app, handler_cancellation=True)
        await self._http.setup()
        site = web.TCPSite(self._http, config.host, config.http_port)
        await site.start()
        http_port = self._http.addresses[0][1]
        self.http_endpoint = f"http://{config.host}:{http_port}"
        logger.info("router: gRPC %s, HTTP %s", self.grpc_endpoint, self.http_endpoint)

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def stop(self, grace_s: float = 10.0) -> None:
        if self._http is not None:
            await self._http.cleanup()
        if self._server is not None:
            await self._server.stop(grace_s)
        if self.policy_runtime is not None:
            await self.policy_runtime.stop()
        await self.pool.close()
        self.tracing.shutdown()
