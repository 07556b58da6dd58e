"""The pool controller's sum of every router's traffic totals, without Ray."""

from __future__ import annotations

from tandem.cluster.traffic_totals import TrafficTotals
from tandem.planner.observe import Counters


def counters(n: float) -> Counters:
    return Counters(first_tokens=n, prompt_tokens=10 * n, generation_tokens=5 * n, finished=n,
                    goodput=n, cached_tokens=2 * n)  # fmt: skip


def test_totals_sum_every_routers_latest_and_never_go_back():
    totals = TrafficTotals(max_routers=2)
    assert totals.total() == Counters()
    totals.report("a", counters(3), now_s=1.0)
    totals.report("b", counters(4), now_s=2.0)
    totals.report("a", counters(5), now_s=3.0)  # a's latest replaces its earlier report
    assert totals.total() == counters(9)
    # A third router: the longest silent one (b) is folded into the departed total, and
    # the sum goes on growing.
    totals.report("c", counters(1), now_s=4.0)
    assert totals.num_routers == 2
    assert totals.total() == counters(10)
    totals.report("c", counters(2), now_s=5.0)
    totals.report("d", counters(1), now_s=6.0)  # folds a (silent since 3.0)
    assert totals.total() == counters(12)
