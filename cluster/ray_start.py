"""Starting Ray, tried again when a node's start times out.

Ray waits a fixed 30 s for a starting node's raylet to register with the GCS
(`ray._private.node.Node`), then raises a bare Exception ("The current node timed out
during startup"). On a loaded 2-core machine that has run out, before any Tandem code
ran, and the next start worked. A node whose start timed out leaves its processes (GCS,
raylet) running and owned by no one, so they are stopped before the next try.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import ray
import ray._private.node

logger = logging.getLogger(__name__)

START_ATTEMPTS = 3

T = TypeVar("T")


class RayStartError(RuntimeError):
    """Ray's node start timed out on every try."""


def kill_half_started_node(exc: BaseException) -> None:
    """Stop the processes of the node whose start raised `exc` (its `Node.__init__`
    frame still holds it: neither `ray.init` nor a `Cluster` got to own it)."""
    tb = exc.__traceback__
    while tb is not None:
        node = tb.tb_frame.f_locals.get("self")
        if isinstance(node, ray._private.node.Node):
            node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
            return
        tb = tb.tb_next


def start_with_retries(start: Callable[[], T], undo: Callable[[], None]) -> T:
    """`start()`, tried up to START_ATTEMPTS times while it times out (a node's start,
    or nodes joining a `Cluster`); `undo()` cleans up after every failed try, and other
    errors are raised at once."""
    errors: list[str] = []
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return start()
        except Exception as exc:  # Ray raises a bare Exception on a start timeout
            kill_half_started_node(exc)
            undo()
            if "timed out" not in str(exc).lower():
                raise
            logger.warning("Ray's start timed out (try %d of %d): %s", attempt, START_ATTEMPTS, exc)
            errors.append(f"{type(exc).__name__}: {exc}")
    raise RayStartError(f"Ray did not start in {START_ATTEMPTS} tries: " + " | ".join(errors))


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """ConnectionError at once when nothing accepts a connection at a Ray address
    (`host:port`, or `ray://host:port`): `ray.init` would retry it for minutes, deaf to
    a command's own timeout. `auto` (the address `ray start` left on this machine) is
    Ray's to find."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"no Ray cluster answers at {address}: {exc}") from None


def start_local_ray(**kwargs: Any) -> None:
    """`ray.init(address="local", ...)`: a fresh instance (never one `ray start` left
    running on this machine), without the dashboard or worker logs in the driver's."""
    start_with_retries(
        lambda: ray.init(address="local", include_dashboard=False, log_to_driver=False, **kwargs),
        ray.shutdown,
    )
