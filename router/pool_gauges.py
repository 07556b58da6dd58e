"""The pool gauges every router re-exports on its /metrics, from the membership it follows.

    tandem:pool_workers{role,state}        workers per role and lifecycle state
    tandem:pool_target_workers{role}       the target size of each role
    tandem:worker_restarts_total{role}     workers replaced after they died

SREs scrape routers, so each router answers them, read at scrape time from the last
`Membership` it applied (the snapshot its placement follows). The pool controller
serves the same collector on its own /metrics, fed from its state, so every endpoint
and `/admin/pools` agree. A router no owner feeds (an in-process test cluster without
a controller) exports none of them; a colocated cluster's target is on the
controller's /metrics only (its membership carries no prefill/decode targets).
"""

from __future__ import annotations

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
        roles = [r for r in WorkerRole if r.value in wanted]
        roles += sorted({w.role for w in membership.workers} - set(roles))
        for role in roles:
            for state in WorkerLifecycle:
                count = sum(w.role is role and w.state is state for w in membership.workers)
                workers.add_metric([role.value, state.value], count)
            if role.value in wanted:
                targets.add_metric([role.value], wanted[role.value])
            restarts.add_metric([role.value], membership.restarts.get(role.value, 0))
        yield workers
        yield targets
        yield restarts
