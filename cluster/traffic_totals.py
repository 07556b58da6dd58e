"""The pool controller's sum of every router's traffic totals (see `cluster.traffic`)."""

from __future__ import annotations

from tandem.planner.observe import Counters

# Routers whose totals are kept apart; past it the longest silent one's are folded into
# the departed total (a restarted router reports under a new id).
MAX_ROUTERS = 256


class TrafficTotals:
    """Every router's latest totals, summed; a router's totals only grow, and those of
    one that stopped reporting stay in the sum, so the sum never goes back."""

    def __init__(self, max_routers: int = MAX_ROUTERS) -> None:
        self.max_routers = max_routers
        # Router id -> (its latest totals, when they came: monotonic s).
        self._latest: dict[str, tuple[Counters, float]] = {}
        self._departed = Counters()

    def report(self, router_id: str, counters: Counters, now_s: float) -> None:
        self._latest[router_id] = (counters, now_s)
        if len(self._latest) > self.max_routers:
            silent = min(self._latest, key=lambda r: self._latest[r][1])
            self._departed = self._departed + self._latest.pop(silent)[0]

    def total(self) -> Counters:
        total = self._departed
        for counters, _ in self._latest.values():
            total = total + counters
        return total

    @property
    def num_routers(self) -> int:
        return len(self._latest)
