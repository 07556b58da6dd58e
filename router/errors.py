"""Errors the router's request path raises; each API maps them to its own status.

gRPC APIs use `grpc_code`; the OpenAI HTTP API uses `http_status` and `openai_type`.
"""

from __future__ import annotations

import math

import grpc


class RouterError(Exception):
    grpc_code = grpc.StatusCode.INTERNAL
    http_status = 500
    openai_type = "internal_error"


class InvalidRequest(RouterError, ValueError):
    """The request itself is wrong (bad field, too long, unknown model, ...)."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400
    openai_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        # The offending field, as OpenAI's error JSON names it.
        self.param = param


class ModelNotFound(InvalidRequest):
    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class Overloaded(RouterError):
    """Admission control shed the request: no worker pair can meet its SLO now."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    openai_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class WorkerUnavailable(RouterError):
    """A worker failed or could not be reached, and no other could take over.

    Retriable: the pools heal (a dead worker is replaced), so the client should retry.
    `retry_after_s` (HTTP `Retry-After`, gRPC trailer `retry-after`) is set when the
    router knows a whole role is down and answers at once instead of waiting.
    """

    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    openai_type = "server_error"

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def retry_after_header(exc: RouterError) -> str | None:
    """The `Retry-After` value (whole seconds, at least 1) an error asks for, if any."""
    retry_after_s = getattr(exc, "retry_after_s", None)
    if retry_after_s is None:
        return None
    return str(max(1, math.ceil(retry_after_s)))


def from_worker_error(exc: grpc.aio.AioRpcError) -> RouterError:
    """The router-level error for a worker RPC failure (keeping its meaning)."""
    code = exc.code()
    details = exc.details() or code.name
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(details)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(f"worker out of capacity: {details}", retry_after_s=1.0)
    error = WorkerUnavailable(f"worker error ({code.name}): {details}")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        error.grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
        error.http_status = 504
    return error


def set_retry_after_trailer(context: grpc.aio.ServicerContext, exc: RouterError) -> None:
    """The call's `retry-after` trailer, if the error asks for one."""
    retry_after = retry_after_header(exc)
    if retry_after is not None:
        context.set_trailing_metadata((("retry-after", retry_after),))


async def abort_with(context: grpc.aio.ServicerContext, exc: RouterError) -> None:
    """End a gRPC call with the error's status (and a `retry-after` trailer if it has one)."""
    set_retry_after_trailer(context, exc)
    await context.abort(exc.grpc_code, str(exc))
