"""A gRPC method handler of a given kind: one message or a stream, in and out (what a
server interceptor that replaces a method's handler must keep)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

_MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def method_handler(
    behavior: Callable[..., Any], request_streaming: bool, response_streaming: bool, **kwargs: Any
) -> grpc.RpcMethodHandler:
    """A handler running `behavior`; `kwargs`: the (de)serializers, as grpc's makers take."""
    return _MAKERS[(request_streaming, response_streaming)](behavior, **kwargs)
