"""How soon a role's next worker may start while its replacements keep dying young.

A worker that dies while starting, or before it has served `stable_s`, is a failure
of its role; failures in a row hold the role's next start back by 0 (one death is not
a loop: the replacement starts at once), then `base_s`, 2 x `base_s`, ... up to
`max_s`. Only a worker started after the role's previous failure extends the series
(workers that die together, with their node, are one failure, not a loop), and a
worker that served `stable_s` or longer, or a failure longer than `stable_s + max_s`
after the last, begins a new one. So a worker that cannot live (Ray kills it for
memory, its node is short of something, its model does not load) is not restarted in
a tight loop that loads the cluster and floods its logs, as Kubernetes' CrashLoopBackOff
holds back a crashing container; the restart counts in the membership show the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.worker.config import WorkerRole


@dataclass(frozen=True)
class BackoffPolicy:
    # The hold after the second failure in a row, doubled for each further one; 0: none.
    base_s: float = 2.0
    # The longest hold.
    max_s: float = 60.0
    # A worker that served this long before it died was not failing to live.
    stable_s: float = 60.0

    def delay_s(self, failures: int) -> float:
        """The hold before the next start after `failures` (>= 1) in a row."""
        if failures <= 1 or self.base_s == 0:
            return 0.0
        # (The exponent capped: 2.0 ** 1024 overflows, and the cap is long reached.)
        return min(self.base_s * 2.0 ** min(failures - 2, 60), self.max_s)


class RestartBackoff:
    """Per role: the failures in a row, when the last was, and the earliest time of its
    next start."""

    def __init__(self, policy: BackoffPolicy) -> None:
        self.policy = policy
        self.failures: dict[WorkerRole, int] = {}
        self._last_failure_s: dict[WorkerRole, float] = {}
        self._not_before_s: dict[WorkerRole, float] = {}

    def died(
        self, role: WorkerRole, now_s: float, started_s: float, served_s: float | None
    ) -> float:
        """A worker of `role` started at `started_s` died after serving `served_s` (None:
        it never served); returns how long the role's next start is held back from now."""
        policy = self.policy
        last_s = self._last_failure_s.get(role)
        young = served_s is None or served_s < policy.stable_s
        if last_s is not None and young and started_s < last_s:
            # Up before the last failure: it died with the others, not after a restart.
            return self.held_s(role, now_s)
        in_series = last_s is not None and now_s - last_s <= policy.stable_s + policy.max_s
        failures = self.failures.get(role, 0) + 1 if young and in_series else 1
        self.failures[role] = failures
        self._last_failure_s[role] = now_s
        delay_s = policy.delay_s(failures)
        self._not_before_s[role] = now_s + delay_s
        return delay_s

    def held_s(self, role: WorkerRole, now_s: float) -> float:
        """How much longer the role's next start waits (0: it may start now)."""
        return max(0.0, self._not_before_s.get(role, 0.0) - now_s)
