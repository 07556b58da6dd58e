"""The typed configuration tree of a whole cluster, built once and passed down.

    ClusterConfig(model_dir,
                  pools=PoolsConfig(num_prefill, num_decode | num_colocated),
                  engine=EngineConfig(...),    # every worker's engine; mode set per role
                  worker=WorkerSettings(...),  # what every worker process shares
                  router=RouterConfig(...),    # learns block size / max model len from workers
                  ray=RayConfig(...),
                  planner=PlannerConfig(...)) # the live P:D planner `tandem serve` runs

Each default is defined once, in the class that owns it; `tandem serve` builds this
tree from its flags (a flag left out keeps the class default). No Ray import here, so
the command line can read defaults without starting Ray.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from pathlib import Path

from tandem.engine.config import EngineConfig, default_device
from tandem.planner.live_config import PlannerConfig, PlannerMode
from tandem.router.config import RouterConfig
from tandem.worker.config import WorkerRole, WorkerSettings, check_kv_backend


@dataclass
class PoolsConfig:
    """How many workers of each role: prefill + decode pools, or colocated workers."""

    num_prefill: int = 1
    num_decode: int = 1
    # Colocated workers replace both pools (num_prefill = num_decode = 0 then).
    num_colocated: int = 0
    # The most workers one role may be scaled to (the budget `tandem scale` checks).
    max_workers_per_role: int = 8
    # How often the pool controller probes every worker; a probe that takes longer
    # than `health_timeout_s` fails, and `max_health_failures` failures in a row (or a
    # worker process that exited) make the worker dead, to be replaced.
    health_interval_s: float = 1.0
    health_timeout_s: float = 5.0
    max_health_failures: int = 3
    # Longest a draining worker may keep running requests before it is stopped anyway
    # (the routers then move what is left to other workers).
    drain_timeout_s: float = 60.0
    # Shortest drain: routers learn of a drain through their watchers, so an idle
    # worker still gets this long for requests placed just before they did.
    drain_min_s: float = 2.0
    # How long a worker asked to drain (`tandem drain`, its node going) serves on while
    # its replacement starts, where the cluster has room for one more: it drains once the
    # replacement serves or after this long (a node's drain waits at most half its
    # deadline). 0: it drains at once, and its role is a worker short until the
    # replacement serves.
    replace_wait_s: float = 120.0
    # How long a dead worker stays listed (state `dead`) after it was found dead.
    dead_retention_s: float = 30.0
    # Restart backoff (cluster.restart_backoff): after a role's second worker in a row
    # dies young (while starting, or serving under `restart_stable_s`), its next start
    # waits `restart_backoff_s` (`--restart-backoff`; 0: none), doubling for each further
    # one up to `restart_backoff_max_s`.
    restart_backoff_s: float = 2.0
    restart_backoff_max_s: float = 60.0
    restart_stable_s: float = 60.0
    # Port of the pool controller's Prometheus /metrics endpoint; 0 picks a free one.
    metrics_port: int = 0

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode", "num_colocated"):
            if getattr(self, name) < 0:
                raise ValueError(f"pools.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_workers_per_role < 1:
            raise ValueError(
                f"pools.max_workers_per_role must be >= 1, got {self.max_workers_per_role}"
            )
        for name in ("num_prefill", "num_decode", "num_colocated"):
            if getattr(self, name) > self.max_workers_per_role:
                raise ValueError(
                    f"pools.{name} ({getattr(self, name)}) is over max_workers_per_role "
                    f"({self.max_workers_per_role})"
                )
        for name in ("health_interval_s", "health_timeout_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"pools.{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.drain_min_s <= self.drain_timeout_s:
            raise ValueError(
                f"pools.drain_min_s must be in [0, drain_timeout_s], got {self.drain_min_s}"
            )
        if self.replace_wait_s < 0:
            raise ValueError(f"pools.replace_wait_s must be >= 0, got {self.replace_wait_s}")
        if self.dead_retention_s < 0:
            raise ValueError(f"pools.dead_retention_s must be >= 0, got {self.dead_retention_s}")
        for name in ("restart_backoff_s", "restart_backoff_max_s", "restart_stable_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"pools.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_health_failures < 1:
            raise ValueError(
                f"pools.max_health_failures must be >= 1, got {self.max_health_failures}"
            )
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"pools.metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.num_colocated and (self.num_prefill or self.num_decode):
            raise ValueError(
                "pools: colocated workers replace the prefill/decode pools; "
                "use PoolsConfig.colocated(k) (num_prefill = num_decode = 0)"
            )
        if not self.num_colocated and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError(
                "pools: a disaggregated cluster needs num_prefill >= 1 and num_decode >= 1, "
                f"got {self.num_prefill} and {self.num_decode}"
            )

    @classmethod
    def colocated(cls, num_workers: int) -> PoolsConfig:
        return cls(num_prefill=0, num_decode=0, num_colocated=num_workers)

    @property
    def roles(self) -> list[WorkerRole]:
        if self.num_colocated:
            return [WorkerRole.COLOCATED] * self.num_colocated
        return [WorkerRole.PREFILL] * self.num_prefill + [WorkerRole.DECODE] * self.num_decode


class ThreadPolicy(enum.StrEnum):
    """torch threads per worker when `--threads` is not given (workers share a node)."""

    # Every worker gets all the node's cores. Prefill and decode workers mostly take
    # turns (a decode step waits for nothing; a prefill burst comes now and then), so
    # each runs at full width when it runs; the default (see docs/architecture.md).
    SHARED = "shared"
    # cores / workers each: no oversubscription when every worker is busy at once.
    SPLIT = "split"


@dataclass
class RayConfig:
    """Where the workers run."""

    # Join an existing Ray cluster ("auto" or host:port); None starts a local one.
    address: str | None = None
    # GPUs each worker actor asks Ray for (cuda only); a fraction lets several workers
    # share one GPU.
    gpus_per_worker: float = 1.0
    # Longest one worker may take from being asked for (waiting for a node included) to
    # serving; past it the start counts as failed and the worker is started again.
    worker_start_timeout_s: float = 600.0
    # Whether each worker asks for one unit of the Ray resource `tandem_<role>` (so an
    # autoscaler adds a node of the right kind for a pending worker). None: when the
    # Ray cluster declares such resources (a local cluster `tandem serve` starts does).
    role_resources: bool | None = None
    # The Ray cluster grows on demand (KubeRay / Ray autoscaler): a target is then not
    # checked against the resources the cluster has now.
    autoscaling: bool = False
    # torch threads per worker when the engine config names none (`ThreadPolicy`).
    thread_policy: ThreadPolicy = ThreadPolicy.SHARED

    def __post_init__(self) -> None:
        gpus = self.gpus_per_worker
        if not math.isfinite(gpus) or gpus <= 0 or (gpus > 1 and not float(gpus).is_integer()):
            raise ValueError(f"ray.gpus_per_worker must be in (0, 1] or whole, got {gpus}")
        if self.worker_start_timeout_s <= 0:
            raise ValueError(
                f"ray.worker_start_timeout_s must be > 0, got {self.worker_start_timeout_s}"
            )


def role_resource(role: WorkerRole) -> str:
    """The Ray resource one worker of `role` asks for (one unit) when role resources are on."""
    return f"tandem_{role.value}"


# init=False: the constructor takes None for the engine and router (their defaults
# depend on `model_dir`), while the attributes are always filled in, so readers need
# no None checks.
@dataclass(init=False)
class ClusterConfig:
    """The whole cluster, built once (by `tandem serve` or a test) and passed down.

    cluster -> pools (how many workers of each role), engine (every worker's engine;
    its `mode` is set per role and `num_threads` None = `ray.thread_policy`), worker
    (settings every worker shares), router, ray.
    """

    model_dir: str
    pools: PoolsConfig
    engine: EngineConfig
    worker: WorkerSettings
    router: RouterConfig
    ray: RayConfig
    planner: PlannerConfig

    def __init__(
        self,
        model_dir: str,
        pools: PoolsConfig | None = None,
        engine: EngineConfig | None = None,
        worker: WorkerSettings | None = None,
        router: RouterConfig | None = None,
        ray: RayConfig | None = None,
        planner: PlannerConfig | None = None,
    ) -> None:
        """None = the class default: for `engine`, the engine defaults for `model_dir`
        on cuda when available, else cpu; for `router`, the router defaults for
        `model_dir`."""
        self.model_dir = model_dir
        self.pools = PoolsConfig() if pools is None else pools
        self.worker = WorkerSettings() if worker is None else worker
        self.ray = RayConfig() if ray is None else ray
        self.planner = PlannerConfig() if planner is None else planner
        model = Path(model_dir).resolve()
        self.engine = (
            EngineConfig(model=model_dir, device=default_device()) if engine is None else engine
        )
        if Path(self.engine.model).resolve() != model:
            raise ValueError(
                f"engine.model ({self.engine.model}) must be model_dir ({self.model_dir})"
            )
        self.router = (
            RouterConfig(model_dir=model_dir, cluster_auth=self.worker.cluster_auth)
            if router is None
            else router
        )
        if Path(self.router.model_dir).resolve() != model:
            raise ValueError(
                f"router.model_dir ({self.router.model_dir}) must be model_dir ({self.model_dir})"
            )
        check_kv_backend(self.worker.kv_backend, self.engine.device)
        budget, per_role = self.planner.max_workers, self.pools.max_workers_per_role
        if self.planner.mode is PlannerMode.OFF and budget is not None:
            raise ValueError(
                "planner.max_workers is the live planner's budget, and the planner is off; "
                "drop it, or run the planner (observe or auto)"
            )
        if (
            self.planner.mode is not PlannerMode.OFF
            and budget is not None
            and budget > 2 * per_role
        ):
            # Every split the planner may recommend has each role within the budget.
            raise ValueError(
                f"planner.max_workers ({budget}) cannot be split with at most "
                f"pools.max_workers_per_role ({per_role}) per role; raise the one or lower "
                "the other"
            )
        started = self.pools.num_prefill + self.pools.num_decode
        if self.planner.mode is not PlannerMode.OFF and budget is not None and budget < started:
            # Its plans would split fewer workers than run (auto: shrink the pools at once).
            raise ValueError(
                f"planner.max_workers ({budget}) is below the {started} prefill + decode "
                "workers the pools start with; raise it or start fewer"
            )
        if self.router.cluster_auth != self.worker.cluster_auth:
            # The router calls the workers with its own; a different one is refused.
            raise ValueError(
                "router.cluster_auth must equal worker.cluster_auth (same token and TLS)"
            )

    @property
    def use_gpu(self) -> bool:
        return self.engine.device.startswith("cuda")

    @property
    def roles(self) -> list[WorkerRole]:
        return self.pools.roles
