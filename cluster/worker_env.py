"""Environment of the worker processes the pool controller starts (Ray `runtime_env`).

Under the `shared` thread policy every worker on a node runs as many torch (OpenMP)
threads as the node has cores, so a prefill and a decode worker together ask for
twice the cores there are. libgomp's default wait policy makes a thread that reaches
the end of a parallel region spin (about 300,000 pause loops, milliseconds) before it
sleeps. That spin is what a decode worker wants when it has the cores to itself: its
step is hundreds of small parallel regions a few microseconds apart, and a sleeping
thread costs a futex wake-up per region (a batch-1 step's GEMMs took 56% longer with
`OMP_WAIT_POLICY=PASSIVE`). So:

- A prefill worker works in bursts (one prompt, then idle): the spin after each burst
  only takes a core from the decode workers, so prefill workers that oversubscribe the
  node (all workers' threads > cores) get `OMP_WAIT_POLICY=PASSIVE`.
- Decode (and colocated) workers keep the spin while their own threads fit the cores
  (one of them under `shared`). Two or more that step at once would each spin on the
  cores the other needs, and a spinning thread that holds a core makes the other's
  parallel regions wait for a time slice: 1P+2D on 2 cores gave 78.6 output tok/s at
  concurrency 8 with every worker spinning and 275.7 with the decode workers passive
  (96.6 and 80.7 at concurrency 1; docs/benchmarks.md). So they get
  `OMP_WAIT_POLICY=PASSIVE` too when their threads together exceed the cores.

When the workers' threads fit the node's cores nothing is set. A worker's wait policy
is fixed when its process starts, so the pool controller decides each worker's variables
as it starts it (`WorkerEnvRule.env`), counting the larger of the pools' targets then and
the pools set at cluster start (`NodePools`): the starting ones and, when the planner
runs in `auto` mode, the most decode workers its budget may turn them into (the budget
less one prefill worker). A second decode worker that `tandem scale` adds to 1P+1D thus
sleeps its threads (1P+2D on 2 cores: 155.4 output tok/s at concurrency 8, against 61.5
with it spinning as the first one does), and under the planner the first decode worker
already sleeps when the budget allows two. Where workers are placed by role resources,
no more of them share a node than the role resources one node offers
(`node_capacity`, the most over the nodes that can take the worker): the Helm chart's
pods offer one each, so a worker there keeps its spin however many pods run. A wait
policy the operator set (`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` in the environment of
`tandem serve`) is left alone, and nothing is set for GPU workers.

Variables of `tandem serve`'s own environment that decide how a worker runs (the wait
policy above, `TRITON_INTERPRET`, which start-up checked the attention backend
against) are forwarded as they are: a worker on a node that joined with `ray start`
inherits that node's environment, not the serve process's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.cluster.config import role_resource
from tandem.planner.live_config import PlannerMode
from tandem.worker.config import WorkerRole

if TYPE_CHECKING:
    from tandem.cluster.config import ClusterConfig


@dataclass(frozen=True)
class NodePools:
    """How many workers share a node's cores: every worker of the pools counted as on one
    node, as `threads_per_worker` does, unless the nodes' role resources say one node
    holds fewer (`capped`)."""

    num_workers: int
    # Decode and colocated workers among them (they step at the same time).
    num_decode_capable: int

    @classmethod
    def of(cls, roles: Iterable[WorkerRole]) -> NodePools:
        roles = list(roles)
        return cls(len(roles), sum(r is not WorkerRole.PREFILL for r in roles))

    @classmethod
    def of_counts(cls, counts: Mapping[WorkerRole, int]) -> NodePools:
        """The pools of so many workers per role (a controller's targets)."""
        return cls.of(role for role, count in counts.items() for _ in range(count))

    @classmethod
    def at_start(cls, config: ClusterConfig) -> NodePools:
        """The pools a cluster's workers are set for from the start: the starting ones,
        and under the planner's `auto` mode the most decode workers its budget may run
        (the budget less one prefill worker)."""
        pools = cls.of(config.roles)
        if config.planner.mode is not PlannerMode.AUTO or config.pools.num_colocated:
            return pools
        budget = config.planner.max_workers or pools.num_workers
        return cls(max(pools.num_workers, budget), max(pools.num_decode_capable, budget - 1))

    def widest(self, other: NodePools) -> NodePools:
        """The larger count of each kind."""
        return NodePools(
            max(self.num_workers, other.num_workers),
            max(self.num_decode_capable, other.num_decode_capable),
        )

    def capped(self, most: NodePools) -> NodePools:
        """The smaller count of each kind: these pools on a node that holds at most
        `most`."""
        return NodePools(
            min(self.num_workers, most.num_workers),
            min(self.num_decode_capable, most.num_decode_capable),
        )


def node_capacity(role: WorkerRole, nodes: Iterable[Mapping[str, Any]]) -> NodePools | None:
    """The most workers one alive node that can take a `role` worker holds, by the role
    resources it offers (`nodes`: `ray.nodes()` entries); None when no node offers the
    role's resource."""
    most: NodePools | None = None
    for node in nodes:
        offered = node.get("Resources", {})
        if not node.get("Alive") or offered.get(role_resource(role), 0) <= 0:
            continue
        slots = NodePools.of_counts({r: int(offered.get(role_resource(r), 0)) for r in WorkerRole})
        most = slots if most is None else most.widest(slots)
    return most


# Environment variables that already say how OpenMP threads wait.
WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# Variables of the serve process's environment every worker gets as they are.
FORWARDED_VARS = (*WAIT_POLICY_VARS, "TRITON_INTERPRET")


@dataclass(frozen=True)
class WorkerEnvRule:
    """What a worker's environment is decided from besides the pools, fixed at cluster
    start: torch threads per worker, the node's cores, the device, and the variables of
    `tandem serve`'s environment that count (`FORWARDED_VARS`)."""

    num_threads: int
    num_cores: int
    device: str
    environ: Mapping[str, str]

    @classmethod
    def of(
        cls, num_threads: int, num_cores: int, device: str, environ: Mapping[str, str]
    ) -> WorkerEnvRule:
        """The rule with only the variables of `environ` that count (it travels to the
        pool controller's process)."""
        kept = {name: environ[name] for name in FORWARDED_VARS if name in environ}
        return cls(num_threads, num_cores, device, kept)

    def env(self, role: WorkerRole, pools: NodePools) -> dict[str, str]:
        """Variables to add to the environment of a `role` worker process started while
        the node runs `pools` (may be empty): the forwarded ones, and passive OpenMP waits
        where those workers' threads oversubscribe the node's cores (see the module doc)."""
        forwarded = dict(self.environ)
        if not self.device.startswith("cpu") or any(v in forwarded for v in WAIT_POLICY_VARS):
            return forwarded
        sharing = pools.num_workers if role is WorkerRole.PREFILL else pools.num_decode_capable
        if self.num_threads * sharing > self.num_cores:
            return {**forwarded, "OMP_WAIT_POLICY": "PASSIVE"}
        return forwarded
