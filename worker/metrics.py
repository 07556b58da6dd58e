"""A worker's Prometheus `/metrics` (engine state + KV transfer), served over aiohttp.

Engine numbers are read from `Engine.stats()` on the engine thread at scrape time,
so they are exact and cost nothing between scrapes. Names follow vLLM's, under
`tandem:`, labelled with the worker id and role.

A worker whose config leaves the metrics port at 0 takes `$TANDEM_WORKER_METRICS_PORT`
when it is set: on Kubernetes each Ray pod hosts one worker, and a PodMonitor needs a
fixed, named port to scrape (the Helm chart sets it on the worker pods).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.engine.outputs import EngineStats
from tandem.worker.engine_loop import EngineLoop

METRICS_PORT_ENV = "TANDEM_WORKER_METRICS_PORT"
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0)  # fmt: skip


class _EngineCollector(Collector):
    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.snapshot: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        names, values = list(self.labels), list(self.labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        yield gauge("tandem:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("tandem:num_requests_waiting", "Requests queued in the engine.", s.num_waiting)
        yield gauge(
            "tandem:kv_cache_usage_perc",
            "Fraction of KV blocks in use (1 = full).",
            1.0 - s.num_free_blocks / s.num_blocks,
        )
        yield gauge("tandem:kv_held_requests", "Prefilled KV pinned for a pull.", s.num_held)
        yield gauge(
            "tandem:num_queued_prefill_tokens",
            "Prompt tokens not yet computed.",
            s.num_queued_prefill_tokens,
        )
        yield counter(
            "tandem:prefix_cache_queries", "Prompt tokens looked up.", s.prefix_cache_queries
        )
        yield counter("tandem:prefix_cache_hits", "Prompt tokens found.", s.prefix_cache_hits)
        yield counter("tandem:num_preemptions", "Requests preempted.", s.num_preemptions)


class WorkerMetrics:
    """Per-worker registry: engine collector + KV transfer instruments."""

    def __init__(self, worker_id: str, role: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"worker_id": worker_id, "role": role}
        self._engine = _EngineCollector(labels)
        self.registry.register(self._engine)
        names = list(labels)
        self.kv_transfer_seconds = Histogram(
            "tandem:kv_transfer_seconds",
            "KV pull time (decode side).",
            names,
            buckets=TRANSFER_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.kv_transfer_bytes = Counter(
            "tandem:kv_transfer_bytes", "KV bytes pulled.", names, registry=self.registry
        ).labels(**labels)
        self.kv_recomputes = Counter(
            "tandem:kv_recomputes",
            "Pulls that failed and were recomputed locally.",
            names,
            registry=self.registry,
        ).labels(**labels)
        # "grpc" (an internal call) or "kv_data" (a TCP KV data connection).
        self._unauthenticated = Counter(
            "tandem:unauthenticated_requests",
            "Internal calls and KV data connections refused for a missing or wrong cluster token.",
            [*names, "kind"],
            registry=self.registry,
        )
        self._labels = labels
        self._runner: web.AppRunner | None = None
        self.endpoint = ""

    def refused(self, kind: str) -> None:
        """Count one refused call or connection (thread-safe)."""
        self._unauthenticated.labels(**self._labels, kind=kind).inc()

    async def start(self, loop: EngineLoop, host: str, port: int) -> str:
        """Serve GET /metrics; returns http://host:port (`port` 0: the port in
        $TANDEM_WORKER_METRICS_PORT, else a free one)."""
        port = port or metrics_port_from_env(os.environ)

        async def scrape(request: web.Request) -> web.Response:
            self._engine.snapshot = loop.stats()
            body = generate_latest(self.registry)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", scrape)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self.endpoint = f"http://{host}:{self._runner.addresses[0][1]}"
        return self.endpoint

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def metrics_port_from_env(environ: Mapping[str, str]) -> int:
    """The port in $TANDEM_WORKER_METRICS_PORT (0 when unset); ValueError naming the
    variable when it is not a port."""
    text = environ.get(METRICS_PORT_ENV, "").strip()
    if not text:
        return 0
    if not text.isdigit() or not 0 < int(text) <= 65535:
        raise ValueError(f"{METRICS_PORT_ENV} must be a port in [1, 65535], got {text!r}")
    return int(text)
