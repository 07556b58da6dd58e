"""The pool controller's Prometheus metrics, read from its `PoolState` at each scrape.

    tandem:pool_workers{role,state}        workers per role and lifecycle state
    tandem:pool_target_workers{role}       the target size of each role
    tandem:worker_restarts_total{role}     workers replaced after they died

Each scrape reads the same state `get_membership()` returns, so `/admin/pools` and
these metrics agree by construction.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.cluster.pool_state import PoolState
from tandem.router.membership import WorkerLifecycle
from tandem.worker.config import WorkerRole


class _PoolCollector(Collector):
    def __init__(self, roles: list[WorkerRole]) -> None:
        self.roles = roles
        self.state: PoolState | None = None

    def collect(self) -> Iterator[Metric]:
        state = self.state
        if state is None:
            return
        workers = GaugeMetricFamily(
            "tandem:pool_workers", "Workers per role and lifecycle state.", labels=["role", "state"]
        )
        targets = GaugeMetricFamily(
            "tandem:pool_target_workers", "Target number of serving workers.", labels=["role"]
        )
        restarts = CounterMetricFamily(
            "tandem:worker_restarts", "Workers replaced after they died.", labels=["role"]
        )
        for role in self.roles:
            for lifecycle in WorkerLifecycle:
                workers.add_metric([role.value, lifecycle.value], state.count(role, lifecycle))
            targets.add_metric([role.value], state.targets.get(role, 0))
            restarts.add_metric([role.value], state.restarts.get(role, 0))
        yield workers
        yield targets
        yield restarts


class PoolMetrics:
    """The controller's own registry (served on its /metrics endpoint)."""

    def __init__(self, roles: list[WorkerRole]) -> None:
        self.registry = CollectorRegistry()
        self._collector = _PoolCollector(roles)
        self.registry.register(self._collector)

    def update(self, state: PoolState) -> None:
        self._collector.state = state
