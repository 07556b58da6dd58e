"""Pool membership as the router sees it: which workers exist and what state each is in.

The router does not own membership. Whoever does (the cluster's pool controller, or a
test) hands the router a `Membership` snapshot through `Router.update_membership`;
the router opens channels to new workers, places new requests only on `SERVING`
ones, lets requests on `DRAINING` workers finish, and migrates requests off `DEAD`
or vanished workers. Admin calls (`GetPools`, `ScalePools`, `DrainWorker`) go to an
`AdminBackend` that the membership owner provides, so this package never imports it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from tandem.worker.config import WorkerRole


class WorkerLifecycle(enum.StrEnum):
    """Where a worker is in its life, as the membership owner sees it."""

    # Placed (or waiting for a node) and loading its model; takes no requests yet.
    STARTING = "starting"
    # Healthy and taking new requests.
    SERVING = "serving"
    # Takes no new requests; its running requests finish (or migrate past a timeout).
    DRAINING = "draining"
    # Gone (process exited, node lost, health checks failed); about to be replaced.
    DEAD = "dead"


@dataclass(frozen=True)
class WorkerInfo:
    """One worker of the cluster."""

    worker_id: str
    role: WorkerRole
    state: WorkerLifecycle
    # host:port of the worker's gRPC server ("" while starting).
    endpoint: str = ""
    # Ray node id (hex) the worker runs on ("" when unknown).
    node: str = ""
    pid: int = 0
    # http://host:port/metrics of the worker ("" while starting).
    metrics_url: str = ""
    # Load at the owner's last health probe (for admin views; the router's policy uses
    # its own live Stats). A load change alone does not bump `Membership.version`.
    running: int = 0
    waiting: int = 0
    # Fraction of the worker's KV blocks in use, 0..1.
    kv_usage: float = 0.0
    # A serving worker asked to drain (`tandem drain`, its node going) while the cluster
    # had room for one more: it serves on until a new worker of its role does, then drains.
    being_replaced: bool = False
    # torch threads of its engine (0 while starting).
    threads: int = 0


@dataclass(frozen=True)
class PoolTargets:
    """How many serving workers each role should have."""

    prefill: int
    decode: int

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class RestartHold:
    """A role whose next worker start is held back, its workers having died young in a
    row (`cluster.restart_backoff`)."""

    # Its workers that died young in a row.
    failures: int
    # When its next start may begin, on the wall clock (`time.time()`): a snapshot read
    # later still says how long is left.
    until_unix_s: float

    def seconds_left(self, now_unix_s: float) -> float:
        return max(0.0, self.until_unix_s - now_unix_s)

    def as_json(self, now_unix_s: float) -> dict[str, float]:
        """The admin API's view (`GET /admin/pools`'s `restart_holds`)."""
        return {
            "failures": self.failures,
            "until_unix_s": self.until_unix_s,
            "seconds_left": round(self.seconds_left(now_unix_s), 1),
        }


def holds_not_passed(holds: Mapping[str, RestartHold], now_unix_s: float) -> dict[str, RestartHold]:
    """Those of `holds` (by role) with time left at `now_unix_s`."""
    return {role: hold for role, hold in holds.items() if hold.seconds_left(now_unix_s) > 0}


@dataclass(frozen=True)
class Membership:
    """A snapshot of the pools; `version` grows with every change its owner makes."""

    version: int
    workers: list[WorkerInfo] = field(default_factory=list)
    targets: PoolTargets | None = None
    # Workers replaced after they died, by role value, since the owner started
    # (`tandem:worker_restarts_total`). A restart alone does not bump `version`: the
    # dead worker's state change that comes with it does.
    restarts: dict[str, int] = field(default_factory=dict)
    # Which owner counted `version` (a pool controller, unique per start): a restarted
    # one counts from 1 again, and names its workers from 0 again.
    owner: str = ""
    # Roles whose next start was held back when the snapshot was made, by role value.
    restart_holds: dict[str, RestartHold] = field(default_factory=dict)


class TargetsChanged(RuntimeError):
    """A compare-and-set scale refused: the targets are no longer its `if_targets`."""


class PoolsOwnerUnreachable(RuntimeError):
    """The pools' owner did not answer: gone (`tandem serve` stopped) or not in time."""


class UnknownWorker(ValueError):
    """An admin call names a worker the pools do not hold (404 / NOT_FOUND)."""


class AdminBackend(Protocol):
    """What the admin API (gRPC `tandem.admin.v1.Admin`, HTTP `/admin/*`) calls.

    Implementations raise `UnknownWorker` for a worker the pools do not hold,
    `ValueError` for other bad input (unknown role, a target out of range),
    `PoolsOwnerUnreachable` when the owner does not answer, and
    `RuntimeError` when the change cannot be made now.
    """

    async def get_pools(self) -> Membership: ...

    async def scale(
        self, targets: PoolTargets, if_targets: PoolTargets | None = None
    ) -> Membership:
        """Set `targets`; with `if_targets`, only while the targets are still those (else
        `TargetsChanged`, nothing changed): a compare-and-set for automatic resizers."""
        ...

    async def drain(self, worker_id: str) -> Membership: ...
