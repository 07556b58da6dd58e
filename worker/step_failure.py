"""How a worker tells the router that its engine step failed, on the wire.

A step that raises ends the engine loop and every request open on it (the worker then
fails its health checks and is replaced). Those requests were in the failed step, so any
of them may have caused it: the router migrates them, but a request present at two such
failures is not moved a third time (router/sequence_flow.py), so one request whose input
breaks the engine cannot take down every worker in turn. The worker answers such a call
with INTERNAL and the trailing metadata below; a lost connection or a killed worker has
neither, and counts as the worker's fault.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from tandem.worker.engine_loop import EngineLoopClosed, EngineStepFailed

# Trailing metadata key of a call that ended because the worker's engine step raised.
ENGINE_STEP_FAILED_KEY = "tandem-engine-step-failed"

ServiceT = TypeVar("ServiceT")
RequestT = TypeVar("RequestT")
ResponseT = TypeVar("ResponseT")
UnaryHandler = Callable[[ServiceT, RequestT, grpc.aio.ServicerContext], Awaitable[ResponseT]]


async def abort_engine_loop_closed(
    context: grpc.aio.ServicerContext, exc: EngineLoopClosed
) -> None:
    """End a call whose engine loop closed under it: INTERNAL with the marker the router
    reads when the call's request was in the step that failed (`EngineStepFailed`), else
    UNAVAILABLE (the loop was already closed, or stopped: the worker's fault)."""
    if isinstance(exc, EngineStepFailed):
        context.set_trailing_metadata(((ENGINE_STEP_FAILED_KEY, "1"),))
        await context.abort(grpc.StatusCode.INTERNAL, str(exc))
    await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))


def answers_engine_loop_closed(
    handler: UnaryHandler[ServiceT, RequestT, ResponseT],
) -> UnaryHandler[ServiceT, RequestT, ResponseT]:
    """A unary handler (Release, Abort, Stats) whose call, when the engine loop is closed,
    ends as `abort_engine_loop_closed` ends it (not as an unexpected UNKNOWN)."""

    @functools.wraps(handler)
    async def answer(
        service: ServiceT, request: RequestT, context: grpc.aio.ServicerContext
    ) -> ResponseT:
        try:
            return await handler(service, request, context)
        except EngineLoopClosed as exc:
            await abort_engine_loop_closed(context, exc)
            raise  # abort raises; this line is never reached

    return answer


def is_engine_step_failure(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a worker call ended because that worker's engine step raised."""
    return any(key == ENGINE_STEP_FAILED_KEY for key, _ in exc.trailing_metadata() or ())
