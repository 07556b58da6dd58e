"""The admin API's logic, shared by gRPC `tandem.admin.v1.Admin` and HTTP `/admin/*`.

The router does not own the pools: every call goes to the `AdminBackend` the pools'
owner gave the router (none: `AdminUnavailable`, 501 / UNIMPLEMENTED). Input is checked
here first, so a bad request never reaches the owner; the owner's own refusals map to
404 / NOT_FOUND (`UnknownWorker`: a drain of a worker the pools do not hold), 400 /
INVALID_ARGUMENT (another `ValueError`: bad input, e.g. a target beyond the budget) and
409 / FAILED_PRECONDITION (`RuntimeError`: cannot be done now).
Each worker's load (`running`, `waiting`, `kv_usage`) is this router's last view of it,
and `predicted_step_s` / `predicted_queue_s` what this router's latency models predict
there (why placement prefers one worker to another).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from tandem.router.errors import InvalidRequest, RouterError
from tandem.router.membership import (
    AdminBackend,
    Membership,
    PoolsOwnerUnreachable,
    PoolTargets,
    UnknownWorker,
    WorkerInfo,
    holds_not_passed,
)

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
# Longer than any worker id the pool controller gives ("<role>-<n>").
MAX_WORKER_ID_CHARS = 128


class AdminUnavailable(RouterError):
    """This router has no pools' owner to forward admin calls to."""

    grpc_code = grpc.StatusCode.UNIMPLEMENTED
    http_status = 501
    openai_type = "server_error"


class AdminOwnerUnavailable(RouterError):
    """The pools' owner (the pool controller) did not answer; retry once it is back."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    openai_type = "server_error"


class AdminWorkerNotFound(InvalidRequest):
    """The call names a worker the pools do not hold."""

    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class AdminRefused(RouterError):
    """The pools' owner cannot make the change now (e.g. a drain already running)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409
    openai_type = "invalid_request_error"


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load from the router's last Stats poll, and what its latency models
    predict."""

    running: int = 0
    waiting: int = 0
    # Fraction of its KV blocks in use, [0, 1].
    kv_usage: float = 0.0
    # This router's predictions (admin.proto `Worker`): decode step with one more
    # sequence (0 for prefill workers), and wait before a new prompt starts prefilling.
    predicted_step_s: float = 0.0
    predicted_queue_s: float = 0.0


def parse_targets(body: Any) -> PoolTargets:
    """`{"prefill": N, "decode": M}` -> PoolTargets; InvalidRequest naming the field."""
    if not isinstance(body, Mapping):
        raise InvalidRequest('the body must be a JSON object {"prefill": N, "decode": M}')
    for key in body:
        if key not in ROLES:
            raise InvalidRequest(
                f"unknown role {key!r}: the pools are {', '.join(ROLES)}", param=str(key)
            )
    for role in ROLES:
        if role not in body:
            raise InvalidRequest(f"{role} is required (target serving workers)", param=role)
        value = body[role]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequest(f"{role} must be an integer >= 1, got {value!r}", param=role)
    return PoolTargets(prefill=body["prefill"], decode=body["decode"])


def restart_holds_json(membership: Membership) -> dict[str, dict[str, float]]:
    """The roles whose next worker start is held back (restart backoff), by role (a
    snapshot's hold that has passed since is left out)."""
    now_unix_s = time.time()
    holds = holds_not_passed(membership.restart_holds, now_unix_s)
    return {role: hold.as_json(now_unix_s) for role, hold in holds.items()}


def _owner_error(exc: Exception) -> RouterError:
    message = str(exc) or type(exc).__name__
    if isinstance(exc, UnknownWorker):
        return AdminWorkerNotFound(message, param="worker_id")
    if isinstance(exc, ValueError):
        param = next((f for f in (*ROLES, "worker_id") if message.startswith(f)), None)
        return InvalidRequest(message, param=param)
    if isinstance(exc, PoolsOwnerUnreachable):
        return AdminOwnerUnavailable(message)
    return AdminRefused(message)


class PoolsAdmin:
    """Checks admin calls and forwards them to the pools' owner."""

    def __init__(
        self,
        backend: AdminBackend | None,
        load: Callable[[str], WorkerLoad | None],
        planner: Callable[[], dict[str, Any] | None] | None = None,
    ) -> None:
        self.backend = backend
        # This router's view of a worker's load (None: not polled by this router).
        self.load = load
        # The live planner's recommendation (the "planner" key), when one runs here.
        self.planner = planner

    def _owner(self) -> AdminBackend:
        if self.backend is None:
            raise AdminUnavailable(
                "this router has no pool controller: admin calls need a router started "
                "by `tandem serve` or `tandem router --ray-address`"
            )
        return self.backend

    async def get_pools(self) -> Membership:
        owner = self._owner()
        try:
            return await owner.get_pools()
        except (ValueError, RuntimeError) as exc:
            raise _owner_error(exc) from exc

    async def scale(self, targets: PoolTargets) -> Membership:
        asked = f"{targets.prefill} prefill + {targets.decode} decode"
        owner = self._owner()
        try:
            membership = await owner.scale(targets)
        except (ValueError, RuntimeError) as exc:
            logger.info("admin: scale to %s refused: %s", asked, exc)
            raise _owner_error(exc) from exc
        logger.info("admin: pools scaled to %s", asked)
        return membership

    async def drain(self, worker_id: Any) -> Membership:
        if not isinstance(worker_id, str) or not worker_id:
            raise InvalidRequest("worker_id must be a non-empty string", param="worker_id")
        if len(worker_id) > MAX_WORKER_ID_CHARS:  # not echoed: the reply stays short
            raise InvalidRequest(
                f"worker_id has {len(worker_id)} characters; worker ids are like 'decode-3' "
                "(see GET /admin/pools)",
                param="worker_id",
            )
        owner = self._owner()
        # Quoted (and checked first): a client's newline must not forge a log line.
        try:
            membership = await owner.drain(worker_id)
        except (ValueError, RuntimeError) as exc:
            logger.info("admin: drain of %r refused: %s", worker_id, exc)
            raise _owner_error(exc) from exc
        logger.info("admin: draining %r", worker_id)
        return membership

    def worker_json(self, worker: WorkerInfo) -> dict[str, Any]:
        load = self.load(worker.worker_id) or WorkerLoad()
        return {
            "id": worker.worker_id,
            "role": worker.role.value,
            "state": worker.state.value,
            "node": worker.node,
            "pid": worker.pid,
            "threads": worker.threads,
            "endpoint": worker.endpoint,
            "metrics_url": worker.metrics_url,
            "running": load.running,
            "waiting": load.waiting,
            "kv_usage": load.kv_usage,
            "being_replaced": worker.being_replaced,
            "predicted_step_s": round(load.predicted_step_s, 6),
            "predicted_queue_s": round(load.predicted_queue_s, 6),
        }

    def to_json(self, membership: Membership) -> dict[str, Any]:
        targets = membership.targets
        return {
            "workers": [self.worker_json(w) for w in membership.workers],
            "targets": {"prefill": targets.prefill, "decode": targets.decode}
            if targets is not None
            else None,
            "version": membership.version,
            # Whose versions they are: a restarted pool controller counts from 1 again.
            "owner": membership.owner,
            "restart_holds": restart_holds_json(membership),
        } | self._planner_json()

    def _planner_json(self) -> dict[str, Any]:
        view = self.planner() if self.planner is not None else None
        return {} if view is None else {"planner": view}
