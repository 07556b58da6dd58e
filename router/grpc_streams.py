"""Writing and ending the router's gRPC server streams (`Generate`, KServe
`ModelStreamInfer`) without waiting on a client that does not read.

A write completes once HTTP/2 flow control lets the message out. A client that stops
reading fills its receive window (64 KiB, or megabytes once gRPC's BDP probe has grown
it) and from then on every write waits on it, for as long as its connection stays open
(its transport still answers keepalive pings). So a write that waits `WRITE_TIMEOUT_S`
(60 s, as the SSE writer's) counts the client as gone: `ClientStalled`, and the stream
ends.

`context.abort` waits too: its status goes out after the messages the client has not
taken. A stream that ends on an error therefore ends with `end_stream`, which sets the
status and returns at once; gRPC sends it when the client reads up to it (or drops it
with the connection), and the handler, with what it holds, is freed now.

The server hears of a client's reading only through HTTP/2 window updates, sent after
the client consumed about half its window: behind a full ~5 MB window, a client reading
50 KB/s let the writes go on after 50 s and 45 s (grpcio, loopback). A client that far
behind and reading slower than about 2 MB a minute is cut as a stalled one.
"""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf.message import Message

from tandem.router.errors import RouterError, set_retry_after_trailer

WRITE_TIMEOUT_S = 60.0


class ClientStalled(Exception):
    """The client took no message for `WRITE_TIMEOUT_S` while a write waited on it."""


async def write_message(
    context: grpc.aio.ServicerContext, message: Message, timeout_s: float | None = None
) -> None:
    """Write one message of a server stream; `ClientStalled` when it waits `timeout_s`
    (default `WRITE_TIMEOUT_S`, read at call time) on the client."""
    timeout_s = WRITE_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            await context.write(message)
    except TimeoutError:
        raise ClientStalled(f"the client took no data for {timeout_s:g} s") from None


def end_stream(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End the stream with this status once the handler returns, without waiting on the
    client (see the module doc); the caller returns next."""
    context.set_code(code)
    context.set_details(details)


def end_stream_with(context: grpc.aio.ServicerContext, exc: RouterError) -> None:
    """`end_stream` with the error's status (and a `retry-after` trailer if it has one)."""
    set_retry_after_trailer(context, exc)
    end_stream(context, exc.grpc_code, str(exc))


def end_stalled(context: grpc.aio.ServicerContext, exc: ClientStalled) -> None:
    """End a stream whose client stopped reading: DEADLINE_EXCEEDED, the stall in its
    details (the client sees it once it reads again)."""
    end_stream(context, grpc.StatusCode.DEADLINE_EXCEEDED, f"{exc}; the stream was ended")
