"""A router's link to the pool controller, found again by name once it is gone.

`tandem serve` restarted on the same Ray cluster starts a new pool controller under
the same name (`tandem-pool-controller`, namespace `tandem`). A router that outlives it
(`tandem router`) holds a handle to the old one, on which every call fails with
`RayActorError`; the membership watcher and the admin backend then `renew()` the link,
and follow the new controller from there.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from tandem.cluster.pool_controller import CONTROLLER_NAME, CONTROLLER_NAMESPACE


def find_controller() -> Any:
    """The running cluster's pool controller (Ray must be initialised)."""
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        raise RuntimeError(
            f"no Tandem cluster on this Ray cluster (no actor {CONTROLLER_NAME!r} in "
            f"namespace {CONTROLLER_NAMESPACE!r}); start one with `tandem serve`"
        ) from None


class ControllerLink:
    """The pool controller's current actor handle, shared by a router's watcher and
    admin backend."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def renew(self) -> bool:
        """Look the name up again; True when another controller answers to it now."""
        try:
            found = await asyncio.to_thread(find_controller)
        except RuntimeError:
            return False
        if found == self.handle:
            return False
        self.handle = found
        return True
