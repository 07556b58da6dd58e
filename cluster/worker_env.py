"""Environment of the worker processes the pool controller starts (Ray `runtime_env`).

Under the `shared` thread policy every worker on a node runs as many torch (OpenMP)
threads as the node has cores, so a prefill and a decode worker together ask for
twice the cores there are. libgomp's default wait policy makes a thread that reaches
the end of a parallel region spin (about 300,000 pause loops, milliseconds) before it
sleeps. That spin is what a decode worker wants: its step is hundreds of small
parallel regions a few microseconds apart, and a sleeping thread costs a futex wake-up
per region (a batch-1 step's GEMMs took 56% longer with `OMP_WAIT_POLICY=PASSIVE`).
A prefill worker works in bursts (one prompt, then idle): there the spin after each
burst only takes a core from the decode worker, so prefill workers that oversubscribe
the node get `OMP_WAIT_POLICY=PASSIVE` (their threads sleep at once).

When the workers' threads fit the node's cores nothing is set. A wait policy the
operator set (`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` in the environment of `tandem
serve`) is left alone, and nothing is set for GPU workers.

Variables of `tandem serve`'s own environment that decide how a worker runs (the wait
policy above, `TRITON_INTERPRET`, which start-up checked the attention backend
against) are forwarded as they are: a worker on a node that joined with `ray start`
inherits that node's environment, not the serve process's.
"""

from __future__ import annotations

from collections.abc import Mapping

from tandem.worker.config import WorkerRole

# Environment variables that already say how OpenMP threads wait.
WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# Variables of the serve process's environment every worker gets as they are.
FORWARDED_VARS = (*WAIT_POLICY_VARS, "TRITON_INTERPRET")


def worker_env_vars(
    role: WorkerRole,
    num_threads: int,
    num_workers: int,
    num_cores: int,
    device: str,
    environ: Mapping[str, str],
) -> dict[str, str]:
    """Variables to add to the environment of a `role` worker process (may be empty):
    the forwarded ones `environ` has, and passive OpenMP waits for prefill workers when
    `num_workers` workers of `num_threads` threads each oversubscribe a node of
    `num_cores` cores."""
    forwarded = {name: environ[name] for name in FORWARDED_VARS if name in environ}
    if not device.startswith("cpu") or any(name in environ for name in WAIT_POLICY_VARS):
        return forwarded
    if role is WorkerRole.PREFILL and num_threads * num_workers > num_cores:
        return {**forwarded, "OMP_WAIT_POLICY": "PASSIVE"}
    return forwarded
