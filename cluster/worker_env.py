"""Environment of the worker processes the pool controller starts (Ray `runtime_env`).

Under the `shared` thread policy every worker on a node runs as many torch (OpenMP)
threads as the node has cores, so a prefill and a decode worker together ask for
twice the cores there are. libgomp's default wait policy then hurts: a thread that
reaches the end of a parallel region spins (about 300,000 pause loops, milliseconds)
before it sleeps, on a core that the other worker's threads, the router or the client
need. `OMP_WAIT_POLICY=PASSIVE` makes idle OpenMP threads sleep at once; on 2 cores a
decode-like loop beside periodic prefill bursts ran several times faster with it (see
docs/architecture.md, "Threads per worker").

When the workers' threads fit the node's cores they keep the default (a short spin
answers the next parallel region sooner). A wait policy the operator set
(`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` in the environment of `tandem serve`) is left
alone, and nothing is set for GPU workers.
"""

from __future__ import annotations

from collections.abc import Mapping

# Environment variables that already say how OpenMP threads wait.
WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def worker_env_vars(
    num_threads: int, num_workers: int, num_cores: int, device: str, environ: Mapping[str, str]
) -> dict[str, str]:
    """Variables to add to every worker process's environment (may be empty): passive
    OpenMP waits when `num_workers` workers of `num_threads` threads each oversubscribe
    a node of `num_cores` cores."""
    if not device.startswith("cpu") or any(name in environ for name in WAIT_POLICY_VARS):
        return {}
    if num_threads * num_workers > num_cores:
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {}
