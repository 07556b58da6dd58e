"""Shared by the pool tests on real Ray: a Ray session with role slots, a small
cluster config, bounded waits on the pool controller's membership, and what a pools
view (`/admin/pools` JSON or a `/metrics` scrape) says about the pools."""

from __future__ import annotations

import asyncio
import collections
import os
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import ray

from tandem.cluster.config import ClusterConfig, PoolsConfig
from tandem.cluster.ray_start import start_local_ray
from tandem.engine.config import EngineConfig
from tandem.proto.cluster_auth import ClusterAuth
from tandem.router.config import RouterConfig
from tandem.router.membership import Membership, WorkerLifecycle
from tests.helpers.grpc_calls import assert_workers_idle
from tests.helpers.kv_budget import TEST_KV_CACHE_BYTES

# What the Ray cluster can place per role (the budget below allows one more).
ROLE_SLOTS = 3


def init_ray_with_role_slots() -> None:
    """A local Ray whose nodes can place ROLE_SLOTS workers of each role."""
    start_local_ray(
        num_cpus=2 * ROLE_SLOTS,
        resources={"tandem_prefill": ROLE_SLOTS, "tandem_decode": ROLE_SLOTS},
    )


def cluster_config(model_dir) -> ClusterConfig:
    return ClusterConfig(
        model_dir=str(model_dir),
        pools=PoolsConfig(
            num_prefill=1,
            num_decode=1,
            max_workers_per_role=ROLE_SLOTS + 1,
            health_interval_s=0.5,
            dead_retention_s=2.0,
            drain_timeout_s=30.0,
        ),
        engine=EngineConfig(
            model=str(model_dir),
            device="cpu",
            num_threads=1,
            max_model_len=512,
            max_num_batched_tokens=256,
            kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
        ),
        router=RouterConfig(
            model_dir=str(model_dir), grpc_port=0, http_port=0, warmup_profile=False
        ),
    )


def serving(m: Membership, role: str) -> list:
    return [w for w in m.workers if w.role == role and w.state is WorkerLifecycle.SERVING]


async def wait_membership(cluster, condition, timeout_s: float, what: str) -> Membership:
    deadline = time.monotonic() + timeout_s
    while True:
        m = await cluster.membership()
        if condition(m):
            return m
        if time.monotonic() > deadline:
            log = await controller_log(cluster)
            raise AssertionError(
                f"timed out after {timeout_s:g} s waiting for {what}: {m}\n"
                f"the pool controller's last log lines:\n{log}"
            )
        await asyncio.sleep(0.2)


async def controller_log(cluster, num_lines: int = 60) -> str:
    """The pool controller's last `tandem` log lines (from its Ray log file), to show
    what the pools went through when a wait on them fails."""
    try:
        pid = await asyncio.wait_for(
            cluster.controller.__ray_call__.remote(lambda _: os.getpid()), 10.0
        )
        session = Path(ray._private.worker._global_node.get_session_dir_path())
        lines = [
            line
            for path in sorted((session / "logs").glob(f"worker-*-{pid}.err"))
            for line in path.read_text(errors="replace").splitlines()
            if " tandem." in line
        ]
    except Exception as exc:  # a diagnostic only: never hide the failure it explains
        return f"(not readable: {exc!r})"
    return "\n".join(lines[-num_lines:])


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("tandem:"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


# (counts of workers by (role, state), targets by role), states with no worker left out.
PoolCounts = tuple[dict[tuple[str, str], int], dict[str, int]]


def admin_pool_counts(view: dict[str, Any]) -> PoolCounts:
    """What an `/admin/pools` JSON view says."""
    counts = collections.Counter((w["role"], w["state"]) for w in view["workers"])
    return dict(counts), dict(view["targets"] or {})


def metrics_pool_counts(samples: dict[str, float]) -> PoolCounts:
    """What the `tandem:pool_*` gauges of a `scrape()` say (absent: no such gauges)."""
    counts: dict[tuple[str, str], int] = {}
    targets: dict[str, int] = {}
    for name, value in samples.items():
        labels = dict(re.findall(r'(\w+)="([^"]*)"', name))
        if name.startswith("tandem:pool_workers{") and value:
            counts[(labels["role"], labels["state"])] = int(value)
        elif name.startswith("tandem:pool_target_workers{"):
            targets[labels["role"]] = int(value)
    return counts, targets


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def assert_idle(
    membership: Membership, max_channels: int | None = None, auth: ClusterAuth | None = None
) -> None:
    """Every serving worker idle; `auth` is the cluster's (its token, when it has one)."""
    workers = [(w.endpoint, w.role.value) for w in membership.workers
               if w.state is WorkerLifecycle.SERVING]  # fmt: skip
    # Transfer channels are reused: a decode worker keeps one per prefill worker it
    # pulled from, a prefill worker one per decode worker that pulled from it.
    num_prefill = sum(role == "prefill" for _, role in workers)
    if max_channels is None:
        max_channels = max(num_prefill, len(workers) - num_prefill)
    await assert_workers_idle(workers, max_channels=max_channels, auth=auth)


async def until(condition, timeout_s: float, what: str = "") -> None:
    """Poll `condition` until true; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what or condition}")
        await asyncio.sleep(0.05)
