"""The CPUs this process may use, which torch threads are counted from.

A process may use fewer CPUs than its machine has: a container's CPU limit (a cgroup
quota: Kubernetes `resources.limits.cpu`, `docker run --cpus`) or CPU set (affinity)
leaves `os.cpu_count()` at every CPU of the host, and a worker that ran that many OpenMP
threads under an 8-CPU quota would be throttled most of each scheduling period.
"""

from __future__ import annotations

import joblib


def available_cpus() -> int:
    """The CPUs this process may use: the smallest of the CPU count, its affinity and its
    cgroup CPU quota (joblib's count); at least 1."""
    return max(1, joblib.cpu_count(only_physical_cores=False))
