"""Workers that share one node's cores: a step slows down while other workers step too.

On a CPU node `tandem serve` runs every worker with `threads` torch threads (the
`shared` thread policy gives each all the cores). A step's time from the profile is
its time alone; while `k` workers step at once and `k · threads` exceeds the cores,
each progresses at `cores / (k · threads)` of that speed (processor sharing). The
simulator keeps each step's remaining work here and asks for new end times whenever
a step starts or ends. `CoreShare(None, ...)` is the default: no sharing (each worker
has its own device), and end times are exactly start + duration.
"""

from __future__ import annotations


class CoreShare:
    def __init__(self, num_cores: float | None, threads_per_worker: int = 1) -> None:
        if num_cores is not None and num_cores <= 0:
            raise ValueError(f"num_cores must be > 0, got {num_cores}")
        if threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {threads_per_worker}")
        self.num_cores = num_cores
        self.threads = threads_per_worker
        # Busy worker -> seconds of work left at full speed, as of `_last_s`.
        self._left: dict[str, float] = {}
        self._last_s = 0.0

    @property
    def shared(self) -> bool:
        return self.num_cores is not None

    def speed(self, num_busy: int) -> float:
        """Share of full speed each of `num_busy` stepping workers gets."""
        if self.num_cores is None or num_busy == 0:
            return 1.0
        return min(1.0, self.num_cores / (num_busy * self.threads))

    def _advance(self, now_s: float) -> None:
        done = (now_s - self._last_s) * self.speed(len(self._left))
        for wid in self._left:
            self._left[wid] = max(0.0, self._left[wid] - done)
        self._last_s = now_s

    def _ends(self, now_s: float) -> dict[str, float]:
        speed = self.speed(len(self._left))
        return {wid: now_s + left / speed for wid, left in self._left.items()}

    def start(self, now_s: float, worker_id: str, duration_s: float) -> dict[str, float]:
        """A step of `duration_s` (alone) starts: every busy worker's new end time."""
        self._advance(now_s)
        self._left[worker_id] = duration_s
        return self._ends(now_s)

    def finish(self, now_s: float, worker_id: str) -> dict[str, float]:
        """`worker_id`'s step ended: the other busy workers' new end times."""
        self._advance(now_s)
        self._left.pop(worker_id, None)
        return self._ends(now_s)
