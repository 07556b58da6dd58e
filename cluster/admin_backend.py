"""The router's `AdminBackend` on a Ray cluster: admin calls go to the pool controller.

Bad input comes back as the controller's `ValueError` (`UnknownWorker`, a target over
the budget) and a change that cannot be made now as its `RuntimeError` (a target the Ray
cluster can never place, a drain of a worker that is not serving), unwrapped from
Ray's task error so the admin API maps them to INVALID_ARGUMENT / FAILED_PRECONDITION.
A call that finds the controller gone is made once more on the one now answering to
its name, if there is one (a restarted `tandem serve`; see `cluster.controller_link`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import ray

from tandem.cluster.controller_link import ControllerLink
from tandem.cluster.pool_controller import CONTROLLER_REPLY_S
from tandem.router.membership import Membership, PoolsOwnerUnreachable, PoolTargets

logger = logging.getLogger(__name__)


class RayAdminBackend:
    """Implements `tandem.router.membership.AdminBackend` over a controller link."""

    def __init__(self, link: ControllerLink, timeout_s: float = CONTROLLER_REPLY_S) -> None:
        self.link = link
        self.timeout_s = timeout_s

    async def get_pools(self) -> Membership:
        return await self._call(lambda controller: controller.get_membership.remote())

    async def scale(
        self, targets: PoolTargets, if_targets: PoolTargets | None = None
    ) -> Membership:
        return await self._call(lambda controller: controller.scale.remote(targets, if_targets))

    async def drain(self, worker_id: str) -> Membership:
        return await self._call(lambda controller: controller.drain.remote(worker_id))

    async def _call(self, call: Callable[[Any], Any]) -> Membership:
        try:
            try:
                return await asyncio.wait_for(call(self.link.handle), self.timeout_s)
            except ray.exceptions.RayActorError:
                if not await self.link.renew():
                    raise
                return await asyncio.wait_for(call(self.link.handle), self.timeout_s)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, ValueError | RuntimeError):
                raise type(cause)(str(cause)) from None
            raise RuntimeError(f"pool controller failed: {cause!r}") from exc
        except TimeoutError:
            raise PoolsOwnerUnreachable(
                f"the pool controller did not answer within {self.timeout_s:g} s"
            ) from None
        except ray.exceptions.RayActorError as exc:
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise PoolsOwnerUnreachable(
                f"the pool controller is gone ({reason}); is `tandem serve` running?"
            ) from None
