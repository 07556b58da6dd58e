"""`tandem serve`: run a cluster until Ctrl-C / SIGTERM, then drain and stop it."""

from __future__ import annotations

import asyncio
import logging
import signal

from tandem.cluster.launcher import ClusterConfig, LocalCluster
from tandem.cluster.traffic import ClusterTraffic
from tandem.engine.dtype import dtype_banner
from tandem.planner.live import LivePlanner, limits_of
from tandem.planner.live_config import PlannerMode
from tandem.router.ports import Listen, check_free, public_listens
from tandem.router.server import Router

logger = logging.getLogger(__name__)

# What stops `tandem serve` (Ctrl-C; SIGTERM from Kubernetes, systemd, `docker stop`).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


async def serve(config: ClusterConfig, announce=print) -> None:
    """Start the cluster, announce its endpoints, wait for a stop signal, stop it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_stop_signals() -> None:
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop.set)

    # Before Ray and the workers start (tens of seconds), not at the router's bind.
    check_free(serve_listens(config))
    on_stop_signals()
    cluster = LocalCluster(config)
    planner = None
    try:
        router = await cluster.start()
        # Again: `ray.init` (in `cluster.start`) installs SIGTERM handlers of its own in
        # this driver process (exit at once; a segfault here), which would cut every
        # stream instead of draining them.
        on_stop_signals()
        planner = await start_planner(config, router, ClusterTraffic(cluster.controller_link))
        announce(
            f"Tandem serving {config.model_dir}, {dtype_banner(config.engine)}, "
            f"attention {config.engine.resolved_attention_backend}"
        )
        if sampling := router.sampling_defaults.from_model():
            values = ", ".join(f"{name} {value:g}" for name, value in sampling.items())
            announce(f"  sampling defaults (the model's generation_config.json): {values}")
        for worker in cluster.workers:
            announce(f"  {worker.role:<9} {worker.worker_id:<12} {worker.endpoint}")
        announce(f"  gRPC  tandem.v1.Generation  {router.grpc_endpoint}")
        announce(f"  HTTP  {router.http_endpoint}/health")
        announce(f"  pool controller metrics  {cluster.controller_metrics_url}")
        announce(f"  more routers: tandem router --ray-address {cluster.ray_address}")
        auth = config.worker.cluster_auth
        announce(f"  internal gRPC + KV transfer: cluster token {auth.fingerprint()} "
                 f"(fingerprint), TLS {'on' if auth.tls else 'off'}")  # fmt: skip
        if planner is not None:
            announce(f"  planner ({config.planner.mode.value}) every "
                     f"{config.planner.interval_s:g} s, budget {planner.budget} workers: "
                     f"{router.http_endpoint}/admin/pools")  # fmt: skip
        announce("Ctrl-C to stop.")
        await stop.wait()
        announce("stopping: draining requests, then workers and Ray")
    finally:
        if planner is not None:
            await planner.stop()
        await cluster.stop()
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


def serve_listens(config: ClusterConfig) -> list[Listen]:
    """The ports `tandem serve` listens on (besides its workers', picked free)."""
    router = config.router
    return [
        *public_listens(router.host, router.grpc_port, router.http_port),
        Listen("pool controller metrics", "--pool-metrics-port", config.worker.host,
               config.pools.metrics_port),
    ]  # fmt: skip


async def start_planner(
    config: ClusterConfig, router: Router, traffic: ClusterTraffic
) -> LivePlanner | None:
    """The live P:D planner beside the router, reading every router's traffic (None when
    `--planner off`)."""
    if config.planner.mode is PlannerMode.OFF:
        return None
    planner = LivePlanner(config.planner, router, limits_of(config.engine), traffic,
                          max_per_role=config.pools.max_workers_per_role)  # fmt: skip
    await planner.start()
    return planner
