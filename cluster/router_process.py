"""A router attached to a running cluster's pool controller.

`tandem serve` runs one in its own process; `tandem router --ray-address` runs more
(one per router replica). Each gets the serving workers at start, follows membership
changes through a `MembershipWatcher`, and answers admin calls through a
`RayAdminBackend`; each builds its own prefix index and latency models.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from tandem.cluster.admin_backend import RayAdminBackend
from tandem.cluster.controller_link import ControllerLink, find_controller
from tandem.cluster.membership_watcher import MembershipWatcher
from tandem.cluster.pool_controller import CONTROLLER_REPLY_S
from tandem.cluster.ray_start import join_ray
from tandem.cluster.traffic import TrafficReporter
from tandem.router.config import RouterConfig
from tandem.router.membership import Membership, WorkerLifecycle
from tandem.router.server import Router
from tandem.router.worker_pool import WorkerEndpoint

logger = logging.getLogger(__name__)


def serving_endpoints(membership: Membership) -> list[WorkerEndpoint]:
    return [
        WorkerEndpoint(w.worker_id, w.role, w.endpoint)
        for w in membership.workers
        if w.state is WorkerLifecycle.SERVING
    ]


class AttachedRouter:
    """Owns a router, the watcher that keeps its membership current, and the reporter
    that tells the pool controller its traffic (for the live planner)."""

    def __init__(self, config: RouterConfig, controller: Any) -> None:
        self.config = config
        self.link = ControllerLink(controller)
        self.router: Router | None = None
        self.watcher: MembershipWatcher | None = None
        self.reporter: TrafficReporter | None = None
        # The pool controller (its start's id) whose cluster token the router holds.
        self._owner = ""

    async def start(self, timeout_s: float = 60.0) -> Router:
        # The controller gives up after timeout_s; the margin bounds a reply that never comes.
        membership: Membership = await asyncio.wait_for(
            self.link.handle.wait_at_target.remote(timeout_s), timeout_s + CONTROLLER_REPLY_S
        )
        admin = RayAdminBackend(self.link)
        workers = serving_endpoints(membership)
        # Owned from here: `stop` ends it whatever the rest of the start does.
        self.router = router = Router(self.config, workers, admin=admin)
        await router.start()
        # Applied once more: the workers are the same, but the router now holds the
        # snapshot (its pool gauges and `membership` start from it, not empty).
        await router.update_membership(membership)
        self._owner = membership.owner
        self.watcher = MembershipWatcher(self.link, self._follow, membership.version)
        self.watcher.start()
        self.reporter = reporter = TrafficReporter(self.link, router)
        reporter.start()
        # The live planner's view from the controller, unless one runs beside this router
        # (`tandem serve`'s sets its own when it starts).
        router.planner_view = lambda: reporter.planner_view
        return router

    async def _follow(self, membership: Membership) -> None:
        """Apply a membership; from a new pool controller (`tandem serve` restarted),
        first take its cluster token: one restarted without a token file made a new
        one, which its workers require (the router kept the old one, and every worker
        refused it for ever)."""
        assert self.router is not None
        if membership.owner != self._owner:
            # Unreadable (TimeoutError, RayError): the watcher hands this membership over
            # again, rather than have it applied with a token the new workers refuse.
            config = await asyncio.wait_for(
                self.link.handle.get_config.remote(), CONTROLLER_REPLY_S
            )
            if config.router.cluster_auth != self.router.pool.auth:
                logger.warning("the new pool controller's cluster has another cluster "
                               "token (tandem serve restarted without a token file): "
                               "using it")  # fmt: skip
                self.router.pool.auth = config.router.cluster_auth
            self._owner = membership.owner
        await self.router.update_membership(membership)

    async def stop(self) -> None:
        if self.watcher is not None:
            await self.watcher.stop()
            self.watcher = None
        if self.router is not None:
            await self.router.stop()
        if self.reporter is not None:  # after the router: its last report counts everything
            await self.reporter.stop()
            self.reporter = None
        self.router = None


async def run_router(ray_address: str, overrides: dict[str, Any], announce=print) -> None:
    """`tandem router`: join the Ray cluster, serve until Ctrl-C / SIGTERM, then stop.

    The router settings are the cluster's (model, SLOs, timeouts) with `overrides`
    (host, ports, API key); the model directory must exist at the same path here.
    """
    import asyncio
    import dataclasses
    import signal

    join_ray(ray_address)
    controller = find_controller()
    try:
        cluster_config = await asyncio.wait_for(controller.get_config.remote(), CONTROLLER_REPLY_S)
    except TimeoutError:
        raise RuntimeError(
            f"the pool controller did not send the cluster's configuration within "
            f"{CONTROLLER_REPLY_S:g} s; is `tandem serve` running and responsive?"
        ) from None
    config = dataclasses.replace(cluster_config.router, **overrides)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    attached = AttachedRouter(config, controller)
    try:
        router = await attached.start(cluster_config.ray.worker_start_timeout_s)
        announce(f"Tandem router for {config.model_dir} (Ray {ray_address})")
        announce(f"  gRPC  tandem.v1.Generation  {router.grpc_endpoint}")
        announce(f"  HTTP  {router.http_endpoint}/health")
        await stop.wait()
    finally:
        started = time.monotonic()
        logger.info("router: stopping")
        await attached.stop()
        logger.info("router: stopped in %.1f s", time.monotonic() - started)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
