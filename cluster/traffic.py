"""The traffic of every router of a cluster, for the live planner.

A router counts only the requests that reach it, and in Kubernetes clients reach the
router pods, never the router `tandem serve` runs beside the pool controller (where the
planner runs). So each router's `TrafficReporter` sends its running totals
(`planner.observe.Counters`: requests started, prompt and generated tokens, finished,
within SLO, prefix-cache hits) to the pool controller every `REPORT_INTERVAL_S`; the
controller sums them (`cluster.traffic_totals`), keeping a departed router's last totals so the
sum never goes back; and the planner reads the sum (`ClusterTraffic.counters`). The
planner's gauges go the same way to the controller's /metrics (`ClusterTraffic.publish`),
which Kubernetes scrapes (the head's router is not scraped), and its `/admin/pools` view
comes back to every router in answer to its report (`TrafficReporter.planner_view`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import ray

from tandem.cluster.controller_link import ControllerLink
from tandem.planner.observe import Counters, read_router_counters
from tandem.router.server import Router

logger = logging.getLogger(__name__)

# How often a router reports its totals; the planner reads them up to this late.
REPORT_INTERVAL_S = 1.0
# Longest wait for the controller to take a report or answer a read.
CONTROLLER_CALL_S = 10.0


class TrafficReporter:
    """Owns one task that reports a router's totals to the pool controller until
    `stop()` (which sends a last report)."""

    def __init__(
        self, link: ControllerLink, router: Router, interval_s: float = REPORT_INTERVAL_S
    ) -> None:
        self.link = link
        self.router = router
        self.interval_s = interval_s
        self.router_id = uuid.uuid4().hex
        # The live planner's view as the controller last answered a report (None: no
        # planner runs, or no answer yet): `/admin/pools` of a router with no planner
        # beside it shows this one.
        self.planner_view: dict[str, Any] | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._report_forever(), name="traffic-reporter")

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        await self._report()

    async def _report_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self._report()

    async def _report(self) -> None:
        """One report; a controller that is gone or slow misses it (the membership
        watcher finds a new one; the next report carries the totals anyway)."""
        try:
            counters = read_router_counters(self.router)
            self.planner_view = await asyncio.wait_for(
                self.link.handle.report_traffic.remote(self.router_id, counters), CONTROLLER_CALL_S
            )
        except (TimeoutError, RuntimeError, ray.exceptions.RayError) as exc:
            logger.debug("traffic: report to the pool controller failed: %s", exc)
        except Exception:  # unexpected: logged; the next report goes out all the same
            logger.exception("traffic: report to the pool controller failed")


class ClusterTraffic:
    """The planner's side: every router's traffic, and where its gauges go."""

    def __init__(self, link: ControllerLink) -> None:
        self.link = link

    async def counters(self) -> Counters:
        return await asyncio.wait_for(self.link.handle.traffic.remote(), CONTROLLER_CALL_S)

    async def publish(
        self,
        recommended: tuple[int, int] | None,
        predicted_rps: float | None,
        observed_rps: float,
        view: dict[str, Any],
    ) -> None:
        """The planner's gauges on the controller's /metrics (None: no plan yet), and its
        view for every router's /admin/pools."""
        await asyncio.wait_for(
            self.link.handle.publish_plan.remote(recommended, predicted_rps, observed_rps, view),
            CONTROLLER_CALL_S,
        )
