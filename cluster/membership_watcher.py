"""Feeds a router the pool membership while it serves (no restart on a change).

Runs in each router process: long-polls the pool controller's `watch()` and hands
every newer `Membership` to a callback (`Router.update_membership`); one the callback
fails on is handed over again (or a newer one) after a pause. A controller
that does not answer is retried with a pause; the router keeps its last view. One that
is gone is looked up again by name (`ControllerLink.renew`): a new controller (a
restarted `tandem serve`) is followed from its first membership.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable

import ray

from tandem.cluster.controller_link import ControllerLink
from tandem.router.membership import Membership

logger = logging.getLogger(__name__)

OnChange = Callable[[Membership], Awaitable[None] | None]


class MembershipWatcher:
    """Owns one task that follows the controller until `stop()`."""

    def __init__(
        self,
        link: ControllerLink,
        on_change: OnChange,
        since_version: int = 0,
        poll_timeout_s: float = 10.0,
        retry_s: float = 1.0,
    ) -> None:
        self.link = link
        self.on_change = on_change
        # The version the router already has (0: none yet).
        self.version = since_version
        self.poll_timeout_s = poll_timeout_s
        self.retry_s = retry_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _follow(self) -> None:
        following = self.link.handle
        gone_logged = False  # said once while no controller answers, not every retry
        while True:
            if self.link.handle != following:  # renewed, here or by the admin backend
                logger.warning("membership: a new pool controller; following it")
                following, self.version, gone_logged = self.link.handle, 0, False
            try:
                # The controller answers by poll_timeout_s; the margin covers Ray's own hops.
                membership: Membership = await asyncio.wait_for(
                    following.watch.remote(self.version, self.poll_timeout_s),
                    self.poll_timeout_s + 10.0,
                )
            except ray.exceptions.RayActorError as exc:
                if self.link.handle == following and not await self.link.renew():
                    if not gone_logged:
                        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
                        logger.warning(
                            "membership: the pool controller is gone (%s); looking for a new "
                            "one every %g s", reason, self.retry_s,
                        )  # fmt: skip
                        gone_logged = True
                    await asyncio.sleep(self.retry_s)
                continue
            except (TimeoutError, ray.exceptions.RayError) as exc:
                logger.warning("membership: controller did not answer (%s); retrying", exc)
                await asyncio.sleep(self.retry_s)
                continue
            # Equal: nothing new (the poll timed out).
            if membership.version == self.version:
                continue
            try:
                result = self.on_change(membership)
                if inspect.isawaitable(result):
                    await result
            except Exception:  # a failed update must not stop the router following changes
                logger.exception("membership: update to version %d failed; trying again in "
                                 "%g s", membership.version, self.retry_s)  # fmt: skip
                # The version stays: the next poll hands over this one, or a newer one.
                await asyncio.sleep(self.retry_s)
                continue
            self.version = membership.version
