"""How soon a role's next worker may start while its workers keep dying young.

A worker that dies while starting, or before it has served `stable_s`, is a failure
of its role; failures in a row hold the role's next start back by 0 (one death is not
a loop: the replacement starts at once), then `base_s`, 2 x `base_s`, ... up to
`max_s`. A worker that served `stable_s` or longer before it died begins a new series
(its replacement starts at once). So a worker that cannot live (Ray kills it for
memory, its node is short of something, its model does not load) is not restarted in
a tight loop that loads the cluster and floods its logs, as Kubernetes' CrashLoopBackOff
holds back a crashing container; the restart counts in the membership show the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.worker.config import WorkerRole


@dataclass(frozen=True)
class BackoffPolicy:
    base_s: float = 2.0
    max_s: float = 60.0
    stable_s: float = 60.0

    def delay_s(self, failures: int) -> float:
        """The hold before the next start after `failures` (>= 1) in a row."""
        if failures <= 1:
            return 0.0
        return min(self.base_s * 2.0 ** (failures - 2), self.max_s)


class RestartBackoff:
    """Per role: the failures in a row and the earliest time of its next start."""

    def __init__(self, policy: BackoffPolicy) -> None:
        self.policy = policy
        self.failures: dict[WorkerRole, int] = {}
        self._not_before_s: dict[WorkerRole, float] = {}

    def died(self, role: WorkerRole, now_s: float, served_s: float | None) -> float:
        """A worker of `role` died after serving `served_s` (None: it never served);
        returns how long the role's next start is held back from now."""
        young = served_s is None or served_s < self.policy.stable_s
        failures = self.failures.get(role, 0) + 1 if young else 1
        self.failures[role] = failures
        delay_s = self.policy.delay_s(failures)
        self._not_before_s[role] = now_s + delay_s
        return delay_s

    def held_s(self, role: WorkerRole, now_s: float) -> float:
        """How much longer the role's next start waits (0: it may start now)."""
        return max(0.0, self._not_before_s.get(role, 0.0) - now_s)
