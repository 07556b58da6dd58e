"""How many torch threads a worker runs when `--threads` is not given.

Counted from the CPUs the process may use (`engine.host_cpus.available_cpus`: affinity
and a container's CPU quota counted, not every CPU of the host). `tandem serve` decides
the threads of the workers on its own node (`--thread-policy`); a worker that Ray places
on another node (a Kubernetes worker pod, a node that joined with `ray start`) counts
that node's CPUs itself as it starts (`threads_away_from`): all of them under `shared`,
under `split` its share among the workers that node may hold by its role resources (one,
on the Helm chart's pods).
"""

from __future__ import annotations

from tandem.cluster.config import ThreadPolicy
from tandem.engine.host_cpus import available_cpus


def threads_per_worker(policy: ThreadPolicy, num_cores: int, num_workers: int) -> int:
    """torch intra-op threads of each worker on a node of `num_cores` cores running
    `num_workers` workers (the starting pools)."""
    if policy is ThreadPolicy.SHARED:
        return max(1, num_cores)
    return max(1, num_cores // max(1, num_workers))


def threads_away_from(home_node: str | None, node: str, home_threads: int, share: int = 1) -> int:
    """The threads of a worker on `node`: `home_threads` (decided by `tandem serve`)
    on its node `home_node` or when the operator gave them (`home_node` None), else the
    CPUs this process may use on its own node divided among `share` workers."""
    if home_node is None or node == home_node:
        return home_threads
    return max(1, available_cpus() // max(1, share))
