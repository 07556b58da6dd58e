"""Starting Ray, tried again when a node's start times out.

Ray waits a fixed 30 s for a starting node's raylet to register with the GCS
(`ray._private.node.Node`), then raises a bare Exception ("The current node timed out
during startup"). On a loaded 2-core machine that has run out, before any Tandem code
ran, and the next start worked. A node whose start timed out leaves its processes (GCS,
raylet) running and owned by no one, so they are stopped before the next try.

A local Ray instance listens on loopback only. Ray gives a node the address of the
interface its default route leaves through, and its gRPC servers (GCS, raylet, every
worker's) then listen on all interfaces; in its single-machine mode (the documented
switch RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, the default on Windows and macOS) the node
is 127.0.0.1 and every one of them listens there. A process joining a cluster at a
loopback address joins in that mode too: otherwise Ray replaces the address by the
outward one, where nothing listens.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import ray
import ray._private.node
import ray._private.ray_constants

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
    host, port = _host_and_port(address)
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"no Ray cluster answers at {address}: {exc}") from None


def _host_and_port(address: str) -> tuple[str, str]:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    return host.strip("[]"), port


def is_loopback_address(address: str) -> bool:
    """Whether a Ray address (`host:port`) names this machine's loopback."""
    host, _ = _host_and_port(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def join_ray(address: str) -> None:
    """Connect this process to the Ray cluster at `address` (once); ConnectionError at
    once when nothing answers there."""
    if ray.is_initialized():
        return
    check_reachable(address)
    mode = single_machine_ray() if is_loopback_address(address) else contextlib.nullcontext()
    with mode:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)


@contextlib.contextmanager
def single_machine_ray() -> Iterator[None]:
    """Ray's single-machine mode while a local node starts: the processes it starts
    inherit the variable, and this one, whose Ray read it at import, gets the constant
    it was read into (the node's address is resolved here, in `ray.init`)."""
    constants = ray._private.ray_constants
    variable = constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    previous, previous_constant = os.environ.get(variable), constants.ENABLE_RAY_CLUSTER
    os.environ[variable] = "0"
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if previous is None:
            del os.environ[variable]
        else:
            os.environ[variable] = previous
        constants.ENABLE_RAY_CLUSTER = previous_constant


def start_local_ray(**kwargs: Any) -> None:
    """`ray.init(address="local", ...)`: a fresh instance (never one `ray start` left
    running on this machine) on loopback only, without the dashboard or worker logs in
    the driver's."""
    with single_machine_ray():
        start_with_retries(
            lambda: ray.init(
                address="local", include_dashboard=False, log_to_driver=False, **kwargs
            ),
            ray.shutdown,
        )
