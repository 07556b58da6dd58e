"""How many torch threads a worker runs when `--threads` is not given.

Counted from the CPUs the process may use (`engine.host_cpus.available_cpus`: affinity
and a container's CPU quota counted, not every CPU of the host). `tandem serve` decides
the threads of the workers on its own node (`--thread-policy`); a worker that Ray places
on another node (a Kubernetes worker pod, a node that joined with `ray start`) counts
that node's CPUs itself as it starts (`AwayThreads`), by the same policy over the workers
that node may hold by its role resources (one, on the Helm chart's pods).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.cluster.config import ThreadPolicy
from tandem.engine.host_cpus import available_cpus


def threads_per_worker(policy: ThreadPolicy, num_cores: int, num_workers: int) -> int:
    """torch intra-op threads of each worker on a node of `num_cores` cores running
    `num_workers` workers (the starting pools)."""
    if policy is ThreadPolicy.SHARED:
        return max(1, num_cores)
    return max(1, num_cores // max(1, num_workers))


@dataclass(frozen=True)
class AwayThreads:
    """How a worker started without `--threads` counts its threads where it runs:
    `tandem serve`'s decision stands on `home_node` (whose CPUs it counted); on another
    node, `policy` over that node's CPUs and the `node_workers` it may hold."""

    home_node: str
    policy: ThreadPolicy
    node_workers: int

    def on(self, node: str) -> int | None:
        """The threads of a worker on `node`; None on the home node."""
        if node == self.home_node:
            return None
        return threads_per_worker(self.policy, available_cpus(), self.node_workers)
