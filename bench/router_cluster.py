"""A real Tandem cluster for the benchmarks, in a child process of its own.

`serve_cluster` is a `router_procs.ServeFn`: it starts a Ray `LocalCluster` (each worker
a Ray actor in its own process, the router in the child's event loop) and hands back
the endpoints. The benchmark's client then runs in the parent, so it shares neither an
event loop nor the GIL with the router. Stopping drains the router and the workers,
removes the placement group and shuts Ray down.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from tandem.cluster.launcher import ClusterConfig, LocalCluster
from tandem.router.worker_pool import WorkerEndpoint


@dataclass(frozen=True)
class ClusterInfo:
    router_endpoint: str
    # The router's HTTP base URL (`/metrics`).
    router_http: str
    workers: tuple[WorkerEndpoint, ...]

    def worker(self, role: str) -> WorkerEndpoint:
        return next(w for w in self.workers if w.role == role)


async def serve_cluster(config: ClusterConfig) -> tuple[ClusterInfo, Callable[[], Awaitable[None]]]:
    cluster = LocalCluster(config)
    try:
        await cluster.start()
    except BaseException:
        await cluster.stop()
        raise
    router = cluster.router
    info = ClusterInfo(router.grpc_endpoint, router.http_endpoint, tuple(cluster.workers))
    return info, cluster.stop


def ensure_model(model_dir: Path, preset: str) -> Path:
    """The model directory, made from `preset` (seed 0) when absent.

    Made in a temporary directory next to it and renamed, so a concurrent maker never
    sees (or leaves) a half-written model.
    """
    if (model_dir / "config.json").is_file():
        return model_dir
    from tandem.engine.model_maker import make_model

    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-", dir=model_dir.parent))
    try:
        make_model(preset, tmp / "model", seed=0)
        try:
            (tmp / "model").rename(model_dir)
        except OSError:
            if not (model_dir / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model_dir
