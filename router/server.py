"""The router process: public gRPC server + HTTP server over one worker pool.

The pools may change while the router serves: their owner (the pool controller, or a
test) calls `update_membership` with each new snapshot. The router then opens channels
to workers that became SERVING, stops placing on DRAINING ones (their requests finish),
and for DEAD or vanished workers ends the calls still on them, so those requests
migrate (see `request_flow`), and closes their channels.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CONTENT_TYPE_LATEST

from tandem.proto.inference.grpc_service_pb2_grpc import add_GRPCInferenceServiceServicer_to_server
from tandem.proto.malformed_requests import MalformedRequestInterceptor
from tandem.proto.server_options import SERVER_OPTIONS
from tandem.proto.tandem.admin.v1 import admin_pb2_grpc
from tandem.proto.tandem.v1 import generation_pb2, generation_pb2_grpc
from tandem.router.admin import PoolsAdmin, WorkerLoad
from tandem.router.admin_http import add_admin_routes
from tandem.router.admin_service import SERVICE_NAME as ADMIN_SERVICE_NAME
from tandem.router.admin_service import AdminService
from tandem.router.api_key import ApiKeyInterceptor
from tandem.router.config import RouterConfig
from tandem.router.generation_service import GenerationService
from tandem.router.http_protocol_errors import OpenAIErrorsAppRunner
from tandem.router.http_server import HANDLER_TASKS, make_http_app
from tandem.router.kserve_service import SERVICE_NAME as KSERVE_SERVICE_NAME
from tandem.router.kserve_service import KserveService
from tandem.router.membership import (
    AdminBackend,
    Membership,
    WorkerInfo,
    WorkerLifecycle,
)
from tandem.router.metrics import RouterMetrics
from tandem.router.openai.body_checks import check_expect
from tandem.router.policy_runtime import PolicyRuntime
from tandem.router.ports import public_listens
from tandem.router.request_flow import RequestFlow
from tandem.router.sampling_defaults import OPENAI_DEFAULTS, SamplingDefaults
from tandem.router.tokenization import PromptTokenizer
from tandem.router.worker_pool import WorkerEndpoint, WorkerPool
from tandem.telemetry.tracing import Tracing
from tandem.worker.config import WorkerRole

logger = logging.getLogger(__name__)

RECEIVE_LIMIT = "grpc.max_receive_message_length"
# How often the public services' gRPC health follows the workers' readiness.
READINESS_INTERVAL_S = 1.0
READINESS_SERVICES = (
    generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
    KSERVE_SERVICE_NAME,
)

# Worker states that keep a worker in the router's pool (DRAINING: requests finish there).
_IN_POOL = frozenset({WorkerLifecycle.SERVING, WorkerLifecycle.DRAINING})
# How often the router retries adding a wanted worker it could not reach.
JOIN_RETRY_INTERVAL_S = 1.0
# How long a stopping router lets the requests in flight finish: within Kubernetes'
# default 30 s between SIGTERM and SIGKILL, with room for the rest of the shutdown.
STOP_GRACE_S = 20.0


class Router:
    """Owns the worker pool, the gRPC server and the HTTP runner."""

    def __init__(
        self,
        config: RouterConfig,
        workers: list[WorkerEndpoint],
        tracing: Tracing | None = None,
        admin: AdminBackend | None = None,
    ) -> None:
        self.config = config
        # Where admin calls go (the pools' owner); None: they answer 501 / UNIMPLEMENTED.
        self.admin_backend = admin
        self.membership: Membership | None = None
        self._membership_lock = asyncio.Lock()
        # Wanted workers that could not be reached when they joined: retried every
        # JOIN_RETRY_INTERVAL_S until they answer or a new membership replaces them.
        self._pending: dict[str, WorkerInfo] = {}
        self._join_retry: asyncio.Task | None = None
        self._readiness: asyncio.Task | None = None
        self.flow: RequestFlow | None = None
        self.tracing = tracing or Tracing("tandem-router", config.trace_exporter)
        self.pool = WorkerPool(workers, config.cluster_auth)
        self.grpc_endpoint = ""
        self.http_endpoint = ""
        self._server: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self.policy_runtime: PolicyRuntime | None = None
        self.tokenizer: PromptTokenizer | None = None
        # Set by `start` from the model directory (router/sampling_defaults.py).
        self.sampling_defaults = OPENAI_DEFAULTS
        # The live planner's view for `/admin/pools` (set by whoever runs one).
        self.planner_view: Callable[[], dict[str, Any] | None] | None = None
        self._stopped = False

    async def start(self) -> None:
        """Start serving; on any failure what was started is stopped before the error
        leaves (a port another process holds: PortInUse)."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        config = self.config
        self.sampling_defaults = defaults = SamplingDefaults.of_model(
            config.model_dir, config.generation_config
        )
        if from_model := defaults.from_model():
            logger.info("sampling defaults from the model's generation_config.json: %s", from_model)
        self.metrics = RouterMetrics(config.model_name)
        self.policy_runtime = PolicyRuntime(config, self.pool)
        policy = await self.policy_runtime.start()
        # Prompts are checked against the length the workers report, not a setting.
        self.tokenizer = tokenizer = PromptTokenizer(
            config.model_dir, self.policy_runtime.limits.max_model_len
        )
        self.flow = flow = RequestFlow(
            self.pool,
            policy,
            self.policy_runtime.slo,
            self.metrics,
            self.tracing,
            config.prefill_timeout_s,
            config.request_timeout_s,
            tokenizer=tokenizer.tokenizer,
            max_migrations=config.max_migrations,
            migration_wait_s=config.migration_wait_s,
            on_worker_failed=self.policy_runtime.mark_unreachable,
        )
        admin = PoolsAdmin(self.admin_backend, self._worker_load, self._planner_json)
        # The key first: a refused call's request is not even parsed.
        interceptors: list[grpc.aio.ServerInterceptor] = [MalformedRequestInterceptor()]
        if config.api_key:
            interceptors.insert(0, ApiKeyInterceptor(config.api_key))
        # A public message may be as large as an HTTP body, no larger: what a prompt may
        # cost the tokenizer thread (8 MiB of text: ~6 s) is the same on every API.
        public_options = [
            *(option for option in SERVER_OPTIONS if option[0] != RECEIVE_LIMIT),
            (RECEIVE_LIMIT, config.max_body_bytes),
        ]
        self._server = server = grpc.aio.server(options=public_options, interceptors=interceptors)
        generation_pb2_grpc.add_GenerationServicer_to_server(
            GenerationService(flow, tokenizer, config.model_name, config.max_n, defaults), server
        )
        kserve = KserveService(flow, tokenizer, self.policy_runtime, config.model_name, defaults)
        add_GRPCInferenceServiceServicer_to_server(kserve, server)
        admin_pb2_grpc.add_AdminServicer_to_server(AdminService(admin), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (
                generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
                KSERVE_SERVICE_NAME,
                ADMIN_SERVICE_NAME,
                health.SERVICE_NAME,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        grpc_listen, http_listen = public_listens(config.host, config.grpc_port, config.http_port)
        try:
            port = server.add_insecure_port(f"{config.host}:{config.grpc_port}")
        except RuntimeError as exc:  # grpc's "Failed to bind to address ..."
            raise grpc_listen.in_use("bind failed") from exc
        self.grpc_endpoint = f"{config.host}:{port}"
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        self._readiness = asyncio.get_running_loop().create_task(
            self._publish_readiness(health_servicer, self.policy_runtime)
        )
        app = make_http_app(
            self.policy_runtime, flow, tokenizer, config, self.policy_runtime.limits.dtype, defaults
        )
        app.router.add_get("/metrics", self._metrics_handler, expect_handler=check_expect)
        add_admin_routes(app, admin)
        # A client that disconnects cancels its handler, which cancels its worker calls.
        self._http = OpenAIErrorsAppRunner(
            app, handler_cancellation=True, shutdown_timeout=STOP_GRACE_S
        )
        await self._http.setup()
        site = web.TCPSite(self._http, config.host, config.http_port)
        try:
            await site.start()
        except OSError as exc:
            raise http_listen.in_use(exc.strerror or str(exc)) from exc
        http_port = self._http.addresses[0][1]
        self.http_endpoint = f"http://{config.host}:{http_port}"
        self._join_retry = asyncio.get_running_loop().create_task(self._retry_joins())
        logger.info("router: gRPC %s, HTTP %s", self.grpc_endpoint, self.http_endpoint)

    async def update_membership(self, membership: Membership) -> None:
        """Apply a new pools snapshot (older or repeated versions of its owner are ignored).

        New SERVING / DRAINING workers get a channel and join the policy (a worker whose
        limits disagree with the pools is refused and logged); only SERVING ones take
        new requests. Workers that are DEAD, STARTING again or absent leave: the calls
        still on them end, so their requests migrate. A snapshot from another owner (a
        restarted pool controller) replaces every worker, same ids included.
        """
        runtime, flow = self.policy_runtime, self.flow
        if runtime is None or flow is None:
            raise RuntimeError("update_membership before Router.start")
        async with self._membership_lock:
            last = self.membership
            new_owner = last is not None and membership.owner != last.owner
            if last is not None and not new_owner and membership.version <= last.version:
                logger.debug("membership version %d ignored (have %d)",
                             membership.version, last.version)  # fmt: skip
                return
            if new_owner:
                logger.info("a new pools owner: every worker is replaced")
            self.membership = membership
            self.metrics.pools.update(membership)
            runtime.follow_restart_holds(membership.restart_holds)
            self._pending.clear()
            wanted = {
                w.worker_id: w for w in membership.workers if w.state in _IN_POOL and w.endpoint
            }
            for current in self.pool.workers:
                info = wanted.get(current.worker_id)
                if (
                    new_owner
                    or info is None
                    or info.endpoint != current.endpoint
                    or info.role != current.role
                ):
                    num_ended = flow.worker_lost(current.worker_id)
                    logger.info("worker %s left the pools (%d calls on it ended; their "
                                "requests migrate)", current.worker_id, num_ended)  # fmt: skip
                    runtime.remove_worker(current.worker_id)
                    self.pool.remove(current.worker_id)
            # Serving workers first: a worker that drains because its replacement now
            # serves must stay placeable until the replacement has joined (joining awaits
            # its Stats), or requests in between would find no worker of the role.
            for info in sorted(
                wanted.values(), key=lambda w: w.state is not WorkerLifecycle.SERVING
            ):
                await self._join(info)

    async def _join(self, info: WorkerInfo) -> None:
        runtime = self.policy_runtime
        assert runtime is not None
        if self.pool.get(info.worker_id) is None:
            await self._add_worker(info)
        if self.pool.get(info.worker_id) is not None:
            runtime.set_placeable(info.worker_id, info.state is WorkerLifecycle.SERVING)

    async def _retry_joins(self) -> None:
        while True:
            await asyncio.sleep(JOIN_RETRY_INTERVAL_S)
            if not self._pending:
                continue
            async with self._membership_lock:
                pending = list(self._pending.values())
                self._pending.clear()
                for info in pending:
                    try:
                        await self._join(info)
                    except Exception:  # unexpected: logged, tried again (the task goes on)
                        logger.exception("worker %s: its join failed; retrying", info.worker_id)
                        self._pending.setdefault(info.worker_id, info)

    async def _add_worker(self, info: WorkerInfo) -> None:
        runtime = self.policy_runtime
        assert runtime is not None
        endpoint = WorkerEndpoint(info.worker_id, info.role, info.endpoint)
        try:
            self.pool.add(endpoint)
            await runtime.add_worker(endpoint)
        except (ValueError, grpc.aio.AioRpcError) as exc:
            if self.pool.get(info.worker_id) is not None:
                runtime.remove_worker(info.worker_id)
                self.pool.remove(info.worker_id)
            if isinstance(exc, grpc.aio.AioRpcError):
                # Not reachable yet (or a blip): try again shortly.
                logger.warning("worker %s not reachable (%s); retrying its join",
                               info.worker_id, exc.code().name)  # fmt: skip
                self._pending[info.worker_id] = info
            else:
                # Disagrees with the pools (block size, model length, role): never joins.
                logger.error("worker %s cannot join the pools: %s", info.worker_id, exc)
            return
        logger.info("worker %s (%s) joined the pools at %s", info.worker_id, info.role.value,
                    info.endpoint)  # fmt: skip

    def _worker_load(self, worker_id: str) -> WorkerLoad | None:
        runtime = self.policy_runtime
        policy = runtime.policy if runtime is not None else None
        state = policy.workers.get(worker_id) if policy is not None else None
        if state is None or state.stats_taken_at_s is None:
            return None
        stats = state.stats
        used = stats.num_blocks - stats.num_free_blocks
        return WorkerLoad(
            running=stats.num_running,
            waiting=stats.num_waiting,
            kv_usage=used / stats.num_blocks if stats.num_blocks else 0.0,
            predicted_step_s=0.0 if state.role is WorkerRole.PREFILL else state.predicted_step_s(1),
            predicted_queue_s=state.predicted_queue_s(),
        )

    def _planner_json(self) -> dict[str, Any] | None:
        return self.planner_view() if self.planner_view is not None else None

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _publish_readiness(
        self, health_servicer: health.aio.HealthServicer, runtime: PolicyRuntime
    ) -> None:
        """gRPC health per public service (`tandem.v1.Generation`, KServe's) follows
        `/health`: SERVING while a request can be served (`PolicyRuntime.is_ready`),
        checked every READINESS_INTERVAL_S, so a load balancer that health-checks a
        service stops sending there. The server's own status ("") stays SERVING while
        the process runs: liveness probes ask it, and a router must not be restarted
        because its workers are down."""
        ready: bool | None = None
        while True:
            try:
                now_ready = await runtime.is_ready()
                if now_ready != ready:
                    status = health_pb2.HealthCheckResponse.SERVING if now_ready else (
                        health_pb2.HealthCheckResponse.NOT_SERVING
                    )  # fmt: skip
                    for service in READINESS_SERVICES:
                        await health_servicer.set(service, status)
                    ready = now_ready
            except Exception:  # one failed check must not end them
                logger.exception("router: readiness check failed")
            await asyncio.sleep(READINESS_INTERVAL_S)

    @staticmethod
    async def _stop_http(runner: web.AppRunner) -> None:
        """Stop the HTTP side: requests in flight get STOP_GRACE_S (the runner's shutdown
        timeout), then are cancelled (aiohttp would give a stream that long again)."""
        cleanup = asyncio.ensure_future(runner.cleanup())
        try:
            await asyncio.wait({cleanup}, timeout=STOP_GRACE_S)
            if not cleanup.done():
                num_cut = runner.app[HANDLER_TASKS].cancel_all()
                logger.warning("router: %d HTTP requests still running after the %g s "
                               "grace; ending them", num_cut, STOP_GRACE_S)  # fmt: skip
            await cleanup
        except BaseException:
            cleanup.cancel()
            raise

    async def stop(self) -> None:
        """Stop taking requests on every API at once, give those in flight up to
        STOP_GRACE_S to finish (HTTP and gRPC alike), then close the worker channels.
        Once: a later call (a failed start stopped the router already) does nothing."""
        if self._stopped:
            return
        self._stopped = True
        if self._readiness is not None:
            self._readiness.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._readiness
        if self._join_retry is not None:
            self._join_retry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._join_retry
        drains = []
        if self._http is not None:
            drains.append(self._stop_http(self._http))
        if self._server is not None:
            drains.append(self._server.stop(STOP_GRACE_S))
        await asyncio.gather(*drains)
        if self.tokenizer is not None:
            self.tokenizer.close()
        if self.policy_runtime is not None:
            await self.policy_runtime.stop()
        await self.pool.close()
        self.tracing.shutdown()
