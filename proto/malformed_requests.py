"""A request message that does not parse is the client's error: INVALID_ARGUMENT.

gRPC's Python server parses a request before the servicer sees it; a message that does
not decode (corrupt wire format, a string field that is not UTF-8) ended the call
UNKNOWN ("Unexpected <class 'DecodeError'>") and logged a traceback at ERROR, one per
call, for any client to fill the log with. `MalformedRequestInterceptor`, on every Tandem
server, parses each request itself: an undecodable one ends its call INVALID_ARGUMENT,
naming the message type, and is logged at DEBUG only.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from tandem.proto.method_handlers import method_handler

logger = logging.getLogger(__name__)


class _Undecodable:
    """What a request that did not parse becomes, for the handler to refuse."""

    def __init__(self, error: DecodeError) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return _Undecodable(exc)

    return deserialize


async def _refuse(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
    logger.debug("malformed request from %s: %s", context.peer(), request.error)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.error}")


async def _respond(result: Any, context: grpc.aio.ServicerContext, streaming: bool) -> Any:
    """What a servicer's method returned, answered: awaited (one response, or a stream it
    writes itself), or its async generator's responses written one by one."""
    if streaming and inspect.isasyncgen(result):
        async with contextlib.aclosing(result):
            async for response in result:
                await context.write(response)
        return None
    return await result


def _unary_request(behavior: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await _refuse(request, context)
        return await _respond(behavior(request, context), context, streaming)

    return handle


async def _checked(requests: AsyncIterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
    async for request in requests:
        if isinstance(request, _Undecodable):
            await _refuse(request, context)
        yield request


def _stream_request(behavior: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
    async def handle(requests: AsyncIterator, context: grpc.aio.ServicerContext) -> Any:
        return await _respond(behavior(_checked(requests, context), context), context, streaming)

    return handle


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Ends a call whose request message does not parse INVALID_ARGUMENT (see the module)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        behaviors = (handler.unary_unary, handler.unary_stream, handler.stream_unary,
                     handler.stream_stream)  # fmt: skip
        behavior = next(b for b in behaviors if b is not None)
        wrap = _stream_request if handler.request_streaming else _unary_request
        wrapped = wrap(behavior, handler.response_streaming)
        return method_handler(
            wrapped,
            handler.request_streaming,
            handler.response_streaming,
            request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
