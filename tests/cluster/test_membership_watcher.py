"""The membership watcher's own rule, without Ray: an update the router fails to apply
(a new controller's config unreadable for a moment, say) is handed over again after a
pause, not skipped until the next change."""

from __future__ import annotations

import asyncio

from tandem.cluster.controller_link import ControllerLink
from tandem.cluster.membership_watcher import MembershipWatcher
from tandem.router.membership import Membership


class OneChange:
    """A controller stand-in whose `watch` has version 2 to give, then nothing new."""

    class _Watch:
        @staticmethod
        async def remote(since_version: int, timeout_s: float) -> Membership:
            if since_version >= 2:
                await asyncio.sleep(timeout_s)
            return Membership(2, owner="new")

    watch = _Watch()


def test_an_update_that_fails_is_handed_over_again():
    applied: list[int] = []
    failures = [RuntimeError("config unreadable")]

    async def on_change(membership: Membership) -> None:
        if failures:
            raise failures.pop()
        applied.append(membership.version)

    async def scenario() -> int:
        watcher = MembershipWatcher(ControllerLink(OneChange()), on_change, since_version=1,
                                    poll_timeout_s=0.05, retry_s=0.05)  # fmt: skip
        watcher.start()
        try:
            for _ in range(100):
                if applied:
                    break
                await asyncio.sleep(0.02)
        finally:
            await watcher.stop()
        return watcher.version

    assert asyncio.run(scenario()) == 2
    assert applied == [2]  # before: the failed version was marked seen, and never applied
