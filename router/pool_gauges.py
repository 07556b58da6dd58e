"""The pool gauges every router re-exports on its /metrics, from the membership it
follows, and the live planner's (`PlannerGauges`, at the end).

    tandem:pool_workers{role,state}        workers per role and lifecycle state
    tandem:pool_target_workers{role}       the target size of each role
    tandem:worker_restarts_total{role}     workers replaced after they died
    tandem:worker_restart_hold_seconds{role}  how much longer the role's next start is held
                                           back, its workers having died young in a row
                                           (cluster.restart_backoff; 0: none)

SREs scrape routers, so each router answers them, read at scrape time from the last
`Membership` it applied (the snapshot its placement follows). The pool controller
serves the same collector on its own /metrics, fed from its state, so every endpoint
and `/admin/pools` agree. A router no owner feeds (an in-process test cluster without
a controller) exports none of them; a colocated cluster's target is on the
controller's /metrics only (its membership carries no prefill/decode targets).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.router.membership import Membership, WorkerLifecycle
from tandem.worker.config import WorkerRole


class PoolGauges(Collector):
    """Registered once in a registry; `update()` with every applied snapshot. Every role
    with a target is reported, zeros included, so a role that lost every worker shows 0
    instead of vanishing from dashboards."""

    def __init__(self, registry: CollectorRegistry) -> None:
        # The last snapshot and the targets by role value, swapped in together.
        self._snapshot: tuple[Membership, dict[str, int]] | None = None
        registry.register(self)

    def update(self, membership: Membership, targets: Mapping[str, int] | None = None) -> None:
        """The snapshot to export; `targets` (role value -> size) when the owner knows
        more than `membership.targets` (a colocated cluster)."""
        if targets is None and membership.targets is not None:
            targets = {"prefill": membership.targets.prefill, "decode": membership.targets.decode}
        self._snapshot = (membership, dict(targets or {}))

    def collect(self) -> Iterator[Metric]:
        if self._snapshot is None:
            return
        membership, wanted = self._snapshot
        workers = GaugeMetricFamily(
            "tandem:pool_workers", "Workers per role and lifecycle state.", labels=["role", "state"]
        )
        targets = GaugeMetricFamily(
            "tandem:pool_target_workers", "Target number of serving workers.", labels=["role"]
        )
        restarts = CounterMetricFamily(
            "tandem:worker_restarts", "Workers replaced after they died.", labels=["role"]
        )
        holds = GaugeMetricFamily(
            "tandem:worker_restart_hold_seconds",
            "How much longer the role's next worker start is held back (restart backoff).",
            labels=["role"],
        )
        now_unix_s = time.time()
        roles = [r for r in WorkerRole if r.value in wanted]
        roles += sorted({w.role for w in membership.workers} - set(roles))
        for role in roles:
            for state in WorkerLifecycle:
                count = sum(w.role is role and w.state is state for w in membership.workers)
                workers.add_metric([role.value, state.value], count)
            if role.value in wanted:
                targets.add_metric([role.value], wanted[role.value])
            restarts.add_metric([role.value], membership.restarts.get(role.value, 0))
            hold = membership.restart_holds.get(role.value)
            holds.add_metric([role.value], hold.seconds_left(now_unix_s) if hold else 0.0)
        yield workers
        yield targets
        yield restarts
        yield holds


class PlannerGauges(Collector):
    """The live planner's view, exported once it has one (`tandem.planner.live`): on
    the router it runs beside, and in a cluster on the pool controller's /metrics too
    (the one Kubernetes scrapes on the head).

        tandem:planner_recommended_workers{role}   the split it recommends
        tandem:planner_predicted_goodput           requests/s within SLO it predicts there
        tandem:planner_observed_goodput            requests/s within SLO over its input window
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.recommended: tuple[int, int] | None = None
        self.predicted_rps: float | None = None
        self.observed_rps: float | None = None
        registry.register(self)

    def observe(self, observed_rps: float) -> None:
        self.observed_rps = observed_rps

    def recommend(self, recommended: tuple[int, int], predicted_rps: float) -> None:
        self.recommended, self.predicted_rps = recommended, predicted_rps

    def collect(self) -> Iterator[Metric]:
        if self.recommended is not None:
            workers = GaugeMetricFamily(
                "tandem:planner_recommended_workers",
                "Workers per role (prefill, decode) the planner recommends.",
                labels=["role"],
            )
            workers.add_metric(["prefill"], self.recommended[0])
            workers.add_metric(["decode"], self.recommended[1])
            yield workers
        if self.predicted_rps is not None:
            yield GaugeMetricFamily(
                "tandem:planner_predicted_goodput",
                "Requests/s within SLO the planner predicts for its recommendation at the "
                "observed load.",
                value=self.predicted_rps,
            )
        if self.observed_rps is not None:
            yield GaugeMetricFamily(
                "tandem:planner_observed_goodput",
                "Requests/s within SLO over the planner's input window (its last 3 intervals).",
                value=self.observed_rps,
            )
