"""The pool controller's sum of every router's traffic totals, and a router's reports
of them, without Ray."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tandem.cluster import traffic
from tandem.cluster.traffic import TrafficReporter
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


class FakeController:
    """A pool controller handle's `report_traffic.remote`, recording each report."""

    def __init__(self) -> None:
        self.reports: list[Counters] = []
        self.report_traffic = SimpleNamespace(remote=self._remote)

    async def _remote(self, router_id: str, counters: Counters) -> None:
        self.reports.append(counters)


def test_a_router_keeps_reporting_after_an_unexpected_failure(monkeypatch):
    """One report failing with an error the reporter does not expect is logged and the
    next goes out (before, the reporting task ended with it, and the planner saw this
    router's traffic frozen)."""
    controller = FakeController()
    reads = iter([ValueError("injected"), counters(1), counters(2)])

    def read(router: object) -> Counters:
        value = next(reads, counters(2))
        if isinstance(value, Exception):
            raise value
        return value

    monkeypatch.setattr(traffic, "read_router_counters", read)
    reporter = TrafficReporter(SimpleNamespace(handle=controller), None, interval_s=0.05)  # type: ignore[arg-type]

    async def scenario() -> None:
        reporter.start()
        async with asyncio.timeout(5):
            while len(controller.reports) < 2:
                await asyncio.sleep(0.02)
        await reporter.stop()

    asyncio.run(scenario())
    assert controller.reports[:2] == [counters(1), counters(2)]
