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


async def _admit_request(request: Any, context: grpc.aio.ServicerContext) -> Any:
    """The request for the servicer; a call whose request did not parse ends here."""
    if isinstance(request, _Undecodable):
        await _refuse(request, context)
    return request


async def _checked(requests: AsyncIterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
    async for request in requests:
        yield await _admit_request(request, context)


async def _admit_requests(requests: AsyncIterator, context: grpc.aio.ServicerContext) -> Any:
    """A request stream for the servicer: the call ends at the first that did not parse."""
    return _checked(requests, context)


def _wrapped(behavior: Callable[..., Any], streaming: bool, admit: Callable[..., Any]):
    """`behavior` run on what `admit` lets through, answered as grpc would answer it: an
    async generator function's responses re-yielded (as cheap as grpc's own iteration;
    writing them with `context.write` cost ~5 us a message more), anything else awaited,
    and an async generator that another kind of function returns written one by one."""
    if streaming and inspect.isasyncgenfunction(behavior):

        async def stream(argument: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
            responses = behavior(await admit(argument, context), context)
            async with contextlib.aclosing(responses):
                async for response in responses:
                    yield response

        return stream

    async def respond(argument: Any, context: grpc.aio.ServicerContext) -> Any:
        result = behavior(await admit(argument, context), context)
        if not (streaming and inspect.isasyncgen(result)):
            return await result
        async with contextlib.aclosing(result):
            async for response in result:
                await context.write(response)
        return None

    return respond


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Ends a call whose request message does not parse INVALID_ARGUMENT (see the module)."""

    def __init__(self) -> None:
        # Per method: the server's handler and its wrapped form, built on the first call
        # (the server hands the same handler for every call of a method).
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        cached = self._wrapped.get(handler_call_details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped_handler = self._wrap(handler, handler.request_deserializer)
        self._wrapped[handler_call_details.method] = (handler, wrapped_handler)
        return wrapped_handler

    @staticmethod
    def _wrap(
        handler: grpc.RpcMethodHandler, deserializer: Callable[[bytes], Any]
    ) -> grpc.RpcMethodHandler:
        behaviors = (handler.unary_unary, handler.unary_stream, handler.stream_unary,
                     handler.stream_stream)  # fmt: skip
        behavior = next(b for b in behaviors if b is not None)
        admit = _admit_requests if handler.request_streaming else _admit_request
        wrapped = _wrapped(behavior, handler.response_streaming, admit)
        return method_handler(
            wrapped,
            handler.request_streaming,
            handler.response_streaming,
            request_deserializer=_tolerant(deserializer),
            response_serializer=handler.response_serializer,
        )
