"""The CPUs a process may use, which torch threads are counted from."""

from __future__ import annotations

import os
import subprocess
import sys

from tandem.engine.host_cpus import available_cpus


def test_available_cpus_counts_the_cpus_the_process_may_use() -> None:
    """A process allowed one CPU (affinity, as `taskset` or a container's CPU set gives
    it) counts one, whatever the machine has; without limits, what `os` allows it."""
    script = "from tandem.engine.host_cpus import available_cpus; print(available_cpus())"
    pinned = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
    )  # fmt: skip
    assert pinned.stdout.strip() == "1"
    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0))
