"""The pool controller's bookkeeping, free of Ray: workers, targets, versions, decisions.

`PoolState` holds one `WorkerRecord` per worker and the target size of each role. The
controller actor (`cluster.pool_controller`) does the I/O (starting, probing and
stopping Ray actors) and tells this class what happened; this class says what to do
next (`plan()`) and keeps the `Membership` snapshot routers see. Every change to that
snapshot bumps `version`, so watchers can wait for "anything newer than N".

Rules:
- a role has `live` workers (starting + serving); fewer than the target: start more;
  more: the surplus goes (a starting one is stopped at once, else the least loaded
  serving one drains). Draining and dead workers never count towards a target.
- a worker being replaced (a drain asked while the cluster had room for one more)
  serves on but no longer counts, so a replacement starts; it drains once new workers
  fill the target without it, or when its wait runs out.
- a target change replaces the previous one whole (the last scale call wins).
- a role whose workers keep dying young starts its next one only after a growing pause
  (`cluster.restart_backoff`).
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from tandem.cluster.restart_backoff import BackoffPolicy, RestartBackoff
from tandem.router.membership import (
    Membership,
    PoolTargets,
    RestartHold,
    UnknownWorker,
    WorkerInfo,
    WorkerLifecycle,
    holds_not_passed,
)
from tandem.worker.config import WorkerRole

ROLE_FIELDS = {"prefill": WorkerRole.PREFILL, "decode": WorkerRole.DECODE}


@dataclass(frozen=True)
class WorkerLoad:
    """What a worker's engine holds, from its last probe."""

    num_running: int = 0
    num_waiting: int = 0
    # Prefilled KV pinned for a pull (prefill side) / KV being written (decode side).
    num_held: int = 0
    num_importing: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0

    @property
    def is_idle(self) -> bool:
        return not (self.num_running or self.num_waiting or self.num_held or self.num_importing)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass
class WorkerRecord:
    """One worker as the controller tracks it."""

    info: WorkerInfo
    # The Ray actor handle (Any: Ray's handle type is dynamic); None in pure tests.
    actor: Any = None
    # Monotonic time of the last state change (start asked, drain begun, found dead).
    since_s: float = 0.0
    # Monotonic time its start was asked (set by `PoolState.add`).
    started_s: float = 0.0
    health_failures: int = 0
    load: WorkerLoad = field(default_factory=WorkerLoad)
    # Set while it is being replaced: the monotonic time it drains at even when no
    # replacement serves by then.
    replace_by_s: float | None = None

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def role(self) -> WorkerRole:
        return self.info.role

    @property
    def state(self) -> WorkerLifecycle:
        return self.info.state


@dataclass(frozen=True)
class Plan:
    """What the controller should do now."""

    # Roles to start one new worker of each, in order (none of a role held back by its
    # restart backoff).
    start: list[WorkerRole] = field(default_factory=list)
    # Starting workers to stop at once (a target went down before they served).
    cancel: list[str] = field(default_factory=list)
    # Serving workers to move to draining.
    drain: list[str] = field(default_factory=list)
    # Workers being replaced to move to draining now: new ones fill the target without
    # them, or their wait ran out.
    replaced: list[str] = field(default_factory=list)


class PoolState:
    """Workers, targets and the membership version of one cluster."""

    def __init__(
        self,
        targets: dict[WorkerRole, int],
        max_workers_per_role: int,
        backoff: BackoffPolicy | None = None,
    ) -> None:
        self.targets = dict(targets)
        self.max_workers_per_role = max_workers_per_role
        self.version = 1
        # This state's own id in every membership it gives out.
        self.owner = uuid.uuid4().hex
        self.records: dict[str, WorkerRecord] = {}
        self.restarts = dict.fromkeys(targets, 0)
        self.backoff = RestartBackoff(backoff or BackoffPolicy())
        # The last hold each role's backoff set, on the wall clock (for the membership).
        self._holds: dict[WorkerRole, RestartHold] = {}
        # Ray nodes being drained: a worker that comes up on one drains at once.
        self.draining_nodes: set[str] = set()
        self._ids = {role: itertools.count() for role in WorkerRole}

    @property
    def colocated(self) -> bool:
        return WorkerRole.COLOCATED in self.targets

    # -- snapshots ------------------------------------------------------------------

    def membership(self) -> Membership:
        workers = [self._with_load(r) for r in self.records.values()]
        targets = None
        if not self.colocated:
            targets = PoolTargets(
                prefill=self.targets[WorkerRole.PREFILL], decode=self.targets[WorkerRole.DECODE]
            )
        restarts = {role.value: n for role, n in self.restarts.items()}
        holds = holds_not_passed({r.value: h for r, h in self._holds.items()}, time.time())
        return Membership(self.version, workers, targets, restarts, self.owner, holds)

    @staticmethod
    def _with_load(record: WorkerRecord) -> WorkerInfo:
        load = record.load
        return replace(
            record.info,
            running=load.num_running,
            waiting=load.num_waiting,
            kv_usage=round(load.kv_usage, 4),
        )

    def count(self, role: WorkerRole, *states: WorkerLifecycle) -> int:
        return sum(r.role is role and r.state in states for r in self.records.values())

    def live(self, role: WorkerRole) -> list[WorkerRecord]:
        """Starting and serving workers of `role` that count towards its target (one
        being replaced does not: its replacement does)."""
        live_states = (WorkerLifecycle.STARTING, WorkerLifecycle.SERVING)
        return [
            r
            for r in self.records.values()
            if r.role is role and r.state in live_states and r.replace_by_s is None
        ]

    def being_replaced(self, role: WorkerRole) -> list[WorkerRecord]:
        return [r for r in self.records.values() if r.role is role and r.replace_by_s is not None]

    def at_target(self) -> bool:
        """Every role has exactly its target serving, and nothing starting, draining or
        being replaced."""
        busy = (WorkerLifecycle.STARTING, WorkerLifecycle.DRAINING)
        return all(
            self.count(role, WorkerLifecycle.SERVING) == target
            and self.count(role, *busy) == 0
            and not self.being_replaced(role)
            for role, target in self.targets.items()
        )

    # -- changes ----------------------------------------------------------------------

    def check_targets(self, targets: PoolTargets) -> dict[WorkerRole, int]:
        """The new targets by role; ValueError naming the field when out of range."""
        if self.colocated:
            raise RuntimeError(
                "pools: this cluster runs colocated workers; prefill/decode targets do not apply"
            )
        if not isinstance(targets, PoolTargets):
            raise ValueError(f"targets must be PoolTargets, got {type(targets).__name__}")
        wanted = {role: getattr(targets, name) for name, role in ROLE_FIELDS.items()}
        for name, role in ROLE_FIELDS.items():
            if wanted[role] > self.max_workers_per_role:
                raise ValueError(
                    f"{name}: {wanted[role]} workers is over the budget of "
                    f"{self.max_workers_per_role} per role"
                )
        return wanted

    def set_targets(self, wanted: dict[WorkerRole, int]) -> None:
        """Replace the targets whole (already checked)."""
        if wanted != self.targets:
            self.targets = dict(wanted)
            self.bump()

    def new_worker_id(self, role: WorkerRole) -> str:
        ids = self._ids[role]
        while True:
            worker_id = f"{role.value}-{next(ids)}"
            if worker_id not in self.records:
                return worker_id

    def add(self, record: WorkerRecord) -> None:
        record.started_s = record.since_s
        self.records[record.worker_id] = record
        self.bump()

    def update(self, worker_id: str, now_s: float, **changes: Any) -> None:
        """Change a worker's public info (state, endpoint, ...); bumps the version. A new
        state ends a replacement (the worker drains, or died)."""
        record = self.records[worker_id]
        if "state" in changes:
            changes["being_replaced"] = False
            record.replace_by_s = None
            record.since_s = now_s
            record.health_failures = 0
        record.info = replace(record.info, **changes)
        self.bump()

    def replace(self, worker_id: str, now_s: float, wait_s: float) -> None:
        """Keep a serving worker serving while `plan()` starts its replacement; it drains
        once new workers fill its role's target without it, or at now_s + wait_s."""
        record = self.records[worker_id]
        record.replace_by_s = now_s + wait_s
        record.info = replace(record.info, being_replaced=True)
        self.bump()

    def came_up(self, worker_id: str, now_s: float, **placement: Any) -> WorkerLifecycle:
        """A started worker's placement (node, endpoint, ...): it serves, or drains at
        once when its node is going (placed there before the node's drain began)."""
        going = placement.get("node") in self.draining_nodes
        state = WorkerLifecycle.DRAINING if going else WorkerLifecycle.SERVING
        self.update(worker_id, now_s, state=state, **placement)
        return state

    def drain_node(self, node: str, replace_by_s: float) -> list[str]:
        """Mark `node` as going (a worker that comes up there drains at once); the ids of
        the serving workers on it now, not yet being replaced, for the caller to drain or
        replace. One there already being replaced is so by `replace_by_s` at the latest."""
        self.draining_nodes.add(node)
        for record in self.records.values():
            if record.info.node == node and record.replace_by_s is not None:
                record.replace_by_s = min(record.replace_by_s, replace_by_s)
        return [
            r.worker_id
            for r in self.records.values()
            if r.info.node == node and r.state is WorkerLifecycle.SERVING and r.replace_by_s is None
        ]

    def mark_dead(self, worker_id: str, now_s: float) -> bool:
        """A worker found dead; True when it was serving or starting (so it counts as
        a restart of its role, and towards its backoff: a draining worker that dies was
        on its way out)."""
        record = self.records[worker_id]
        if record.state is WorkerLifecycle.DEAD:
            return False
        # One being replaced has its replacement under way already.
        replaced = (
            record.state in (WorkerLifecycle.STARTING, WorkerLifecycle.SERVING)
            and record.replace_by_s is None
        )
        served_s = now_s - record.since_s if record.state is WorkerLifecycle.SERVING else None
        self.update(worker_id, now_s, state=WorkerLifecycle.DEAD)
        if replaced:
            self.restarts[record.role] = self.restarts.get(record.role, 0) + 1
            held_s = self.backoff.died(record.role, now_s, record.started_s, served_s)
            if held_s > 0:
                failures = self.backoff.failures[record.role]
                self._holds[record.role] = RestartHold(failures, time.time() + held_s)
        return replaced

    def remove(self, worker_id: str) -> WorkerRecord:
        record = self.records.pop(worker_id)
        self.bump()
        return record

    def expired_dead(self, now_s: float, retention_s: float) -> list[str]:
        return [
            r.worker_id
            for r in self.records.values()
            if r.state is WorkerLifecycle.DEAD and now_s - r.since_s >= retention_s
        ]

    def drain_target(self, worker_id: str) -> WorkerRecord:
        """The worker a drain call names; ValueError when unknown or not serving."""
        record = self.records.get(worker_id)
        if record is None:
            raise UnknownWorker(f"worker_id: no worker {worker_id!r} in the pools")
        if record.state is not WorkerLifecycle.SERVING:
            raise RuntimeError(
                f"worker_id: {worker_id} is {record.state.value}; only a serving worker drains"
            )
        if record.replace_by_s is not None:
            raise RuntimeError(
                f"worker_id: {worker_id} is being replaced already (it drains once its "
                "replacement serves)"
            )
        return record

    def bump(self) -> None:
        self.version += 1

    def plan(self, now_s: float) -> Plan:
        """Start, cancel or drain so that each role's live count meets its target, and
        drain the workers being replaced that the target no longer needs."""
        plan = Plan()
        for role, target in self.targets.items():
            live = self.live(role)
            plan.replaced.extend(self._replacements_done(role, target, live, now_s))
            if len(live) < target:
                if self.backoff.held_s(role, now_s) == 0.0:
                    plan.start.extend([role] * (target - len(live)))
                continue
            surplus = len(live) - target
            starting = [r for r in live if r.state is WorkerLifecycle.STARTING]
            # Newest first: the one furthest from serving gives up the least.
            for record in sorted(starting, key=lambda r: -r.since_s)[:surplus]:
                plan.cancel.append(record.worker_id)
            surplus -= min(surplus, len(starting))
            serving = [r for r in live if r.state is WorkerLifecycle.SERVING]
            by_load = sorted(
                serving, key=lambda r: (r.load.num_running + r.load.num_waiting, -r.since_s)
            )
            plan.drain.extend(r.worker_id for r in by_load[:surplus])
        return plan

    def _replacements_done(
        self, role: WorkerRole, target: int, live: list[WorkerRecord], now_s: float
    ) -> list[str]:
        """The workers of `role` being replaced that drain now: those whose wait ran out,
        and those that new serving workers make unneeded for the target (the least
        loaded first: the busiest keep serving until the last replacement does)."""
        replaced = self.being_replaced(role)
        overdue = [r for r in replaced if r.replace_by_s is not None and now_s >= r.replace_by_s]
        waiting = [r for r in replaced if r not in overdue]
        new_serving = sum(r.state is WorkerLifecycle.SERVING for r in live)
        unneeded = max(0, len(waiting) - max(0, target - new_serving))
        by_load = sorted(waiting, key=lambda r: r.load.num_running + r.load.num_waiting)
        return [r.worker_id for r in overdue + by_load[:unneeded]]
