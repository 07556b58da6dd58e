"""Attempts: one placement of a sequence on a worker pair, and how its calls fail.

A sequence runs as one attempt, or several when a worker fails (migration). The flow
registers each attempt under the workers it uses, so that the membership owner's
`worker_lost` can end the call in flight there; a failed call leaves the attempt as
`AttemptFailed`, which never leaves the request flow (the client sees a `RouterError`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from typing import Any

import grpc

from tandem.router.errors import RouterError, WorkerUnavailable, from_worker_error
from tandem.router.policy import Placement
from tandem.worker.step_failure import is_engine_step_failure

# Status codes of a worker call that mean the worker or the connection failed (not the
# request): the request may continue elsewhere. Our own cancellation is not among them
# (it surfaces as asyncio.CancelledError); CANCELLED here is the server's doing.
MIGRATABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
    }
)


class MigrationReason(enum.StrEnum):
    """The `reason` label of `tandem:request_migrations_total`."""

    # The prefill call failed (the worker died with the prompt queued or running).
    PREFILL_FAILED = "prefill_failed"
    # The decode stream broke (worker died, connection lost).
    DECODE_FAILED = "decode_failed"
    # The membership owner declared the worker dead or removed it (a drain that timed out).
    WORKER_LOST = "worker_lost"


class AttemptFailed(Exception):
    """A worker call of one attempt failed; internal to the flow, never leaves it."""

    def __init__(
        self,
        worker_id: str,
        reason: MigrationReason,
        error: RouterError,
        migratable: bool,
        engine_step_failed: bool = False,
    ) -> None:
        super().__init__(str(error))
        self.worker_id = worker_id
        self.reason = reason
        self.error = error
        self.migratable = migratable
        # The worker's engine step raised with this sequence in it (worker/step_failure.py).
        self.engine_step_failed = engine_step_failed


def worker_lost_failure(worker_id: str) -> AttemptFailed:
    """The failure of an attempt whose worker left (declared lost, or gone from the pool)."""
    error = WorkerUnavailable(f"worker {worker_id} was lost")
    return AttemptFailed(worker_id, MigrationReason.WORKER_LOST, error, migratable=True)


def call_failure(
    worker_id: str, reason: MigrationReason, exc: grpc.aio.AioRpcError
) -> AttemptFailed:
    """The failure of an attempt whose call to `worker_id` ended with `exc`."""
    migratable = exc.code() in MIGRATABLE_CODES
    return AttemptFailed(
        worker_id,
        reason,
        from_worker_error(exc),
        migratable=migratable,
        engine_step_failed=is_engine_step_failure(exc),
    )


def really_cancelled() -> bool:
    """Whether our own task is being cancelled (client gone), not just a worker call."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


@dataclasses.dataclass(eq=False)
class Attempt:
    """One placement of a sequence: the worker call in flight, so a lost worker can end it."""

    worker_ids: tuple[str, ...]
    # The call in flight and the worker it runs on.
    call: Any = None
    call_worker_id: str = ""
    # Workers the membership owner declared lost while this attempt used them.
    lost: set[str] = dataclasses.field(default_factory=set)

    def lose(self, worker_id: str) -> bool:
        """Mark the worker lost; True when that ended this attempt's call on it."""
        self.lost.add(worker_id)
        if self.call is None or self.call_worker_id != worker_id:
            return False
        self.call.cancel()
        return True

    def start_call(self, worker_id: str, call: Any) -> None:
        """Track `call` to `worker_id`; refused (and cancelled) if that worker is lost."""
        if worker_id in self.lost:
            call.cancel()
            raise worker_lost_failure(worker_id)
        self.call, self.call_worker_id = call, worker_id

    def end_call(self) -> None:
        self.call = None

    def failure_on_cancel(self, worker_id: str) -> AttemptFailed | None:
        """Why a call to `worker_id` was cancelled: the worker was lost (the sequence
        migrates), or None when the client left (the cancellation goes on)."""
        if worker_id in self.lost and not really_cancelled():
            return worker_lost_failure(worker_id)
        return None


class AttemptRegistry:
    """The attempts in flight, per worker id (what `worker_lost` ends, a drain waits for)."""

    def __init__(self) -> None:
        self._by_worker: dict[str, set[Attempt]] = {}

    def begin(self, placement: Placement) -> Attempt:
        ids = tuple(w for w in (placement.prefill_worker_id, placement.decode_worker_id) if w)
        attempt = Attempt(ids)
        for worker_id in ids:
            self._by_worker.setdefault(worker_id, set()).add(attempt)
        return attempt

    def end(self, attempt: Attempt) -> None:
        for worker_id in attempt.worker_ids:
            attempts = self._by_worker.get(worker_id)
            if attempts is not None:
                attempts.discard(attempt)
                if not attempts:
                    del self._by_worker[worker_id]

    def lose_worker(self, worker_id: str) -> int:
        """End the calls on a lost worker; returns how many were in flight (the attempts
        that used it and moved on to another worker are marked, not counted)."""
        attempts = list(self._by_worker.get(worker_id, ()))
        return sum(attempt.lose(worker_id) for attempt in attempts)

    def num_on(self, worker_id: str) -> int:
        return len(self._by_worker.get(worker_id, ()))
