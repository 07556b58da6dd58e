"""Server-sent events for streamed completions: `data: {json}\\n\\n` ... `data: [DONE]`.

The first chunk is awaited before the response starts, so a request refused up front
(overloaded, worker down) still gets a real HTTP status. After that, an error becomes an
`{"error": ...}` event followed by `[DONE]` (what OpenAI clients raise on); so does a
stream the stopping router ends when its grace runs out (its handler cancelled): a
`server_error` the client can retry, not a stream that stops short without a word.

While no event goes out, a `: keep-alive` comment does every KEEPALIVE_S, so proxies
do not cut a stream that waits (for a migration, say). Whoever calls `stream_sse` owns
the chunk iterator and closes it; a client that goes away surfaces here as a failed
write (or the handler's cancellation), which ends the stream so the owner's close
cancels the worker calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from tandem.router.errors import RouterError, WorkerUnavailable
from tandem.router.generation_chunk import GenerationChunk, Usage
from tandem.router.openai.client_backlog import unsent_bytes
from tandem.router.openai.errors import HttpApiError, dumps, error_body
from tandem.router.openai.responses import ResponseBuilder

logger = logging.getLogger(__name__)

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
}


# Longest a stream ended by the router's stop waits to tell its client so.
ENDING_WRITE_S = 1.0
# A comment every this long while no event goes out: a stream can be silent for a
# while (a migrating sequence waits up to `migration_wait_s`, 60 s, for a decode
# worker), as long as many proxies' and load balancers' idle timeouts. SSE clients
# skip comments.
KEEPALIVE_S = 15.0
KEEPALIVE_COMMENT = b": keep-alive\n\n"
# A client that takes no byte for this long while a write waits on it (it reads
# nothing, its connection's buffers are full) counts as gone: its stream ends, and with
# it the request's worker calls, instead of the handler waiting on it for as long as the
# connection stays open. A slow client is not cut as long as TCP shows it taking bytes
# (its receive window reopening) within this long; one reading a few KB/s may not.
WRITE_TIMEOUT_S = 60.0
# How often a waiting write looks whether its client took anything.
PROGRESS_CHECK_S = 1.0


def sse_event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else dumps(payload)
    return f"data: {data}\n\n".encode()


async def stream_sse(
    request: web.Request,
    chunks: AsyncIterator[GenerationChunk],
    builder: ResponseBuilder,
    extra_headers: dict[str, str],
) -> web.StreamResponse:
    """Stream `chunks` as SSE; raises (before any byte is sent) if the first chunk fails."""
    first = await anext(chunks, None)
    response = web.StreamResponse(headers={**SSE_HEADERS, **extra_headers})
    await response.prepare(request)
    writer = SseWriter(response, lambda: unsent_bytes(request.transport))
    keep_alive = asyncio.create_task(writer.keep_alive(), name=f"keep-alive {builder.id}")
    try:
        await _write_events(writer, first, chunks, builder)
    finally:
        keep_alive.cancel()
        (ended,) = await asyncio.gather(keep_alive, return_exceptions=True)
        if isinstance(ended, Exception):
            logger.error("stream %s: its keep-alive failed", builder.id, exc_info=ended)
    return response


async def _write_events(
    writer: SseWriter,
    first: GenerationChunk | None,
    chunks: AsyncIterator[GenerationChunk],
    builder: ResponseBuilder,
) -> None:
    usage: Usage | None = None
    try:
        for opening in builder.opening_chunks():
            await writer.write(sse_event(opening))
        chunk = first
        while chunk is not None:
            usage = chunk.usage or usage
            builder.count_tokens(chunk)
            body = builder.chunk(chunk)
            if body is not None:
                await writer.write(sse_event(body))
            chunk = await anext(chunks, None)
        if builder.options.include_usage and usage is not None:
            await writer.write(sse_event(builder.usage_chunk(usage)))
    except ConnectionResetError as exc:  # aiohttp's ClientConnectionResetError is one
        logger.info("client of %s went away mid-stream: %s", builder.id, exc)
        return
    except asyncio.CancelledError:
        # The router stopping (its grace over), or the client gone (then this write fails).
        stopping = WorkerUnavailable("the router stopped before this stream finished; retry it")
        ending = sse_event(error_body(stopping)) + sse_event("[DONE]")
        # Bounded: a client that reads nothing must not hold up the stop.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(writer.write_quietly(ending, eof=True), ENDING_WRITE_S)
        raise
    except RouterError as exc:
        logger.warning("stream %s failed: %s", builder.id, exc)
        if not await writer.write_quietly(sse_event(error_body(exc))):
            return
    except Exception:
        logger.exception("stream %s: unexpected error", builder.id)
        error = HttpApiError(500, "internal server error; see the router log", "internal_error")
        if not await writer.write_quietly(sse_event(error_body(error))):
            return
    if await writer.write_quietly(sse_event("[DONE]"), eof=True):
        logger.debug("stream %s done", builder.id)


class SseWriter:
    """Writes one prepared SSE response, an event at a time, and a comment whenever
    KEEPALIVE_S pass without a write (`keep_alive()`, a task its stream owns).

    `unsent`: how many bytes written so far the client has not taken (see
    client_backlog.py); a write waiting on the client lasts while that number falls.
    """

    def __init__(self, response: web.StreamResponse, unsent: Callable[[], int]) -> None:
        self.response = response
        self._unsent = unsent
        self._lock = asyncio.Lock()  # one write at a time: events stay whole
        self._last_write_s = time.monotonic()
        self._ended = False

    async def write(self, data: bytes, eof: bool = False) -> None:
        """ConnectionResetError when the client is gone, or takes nothing for
        WRITE_TIMEOUT_S while this write waits on it."""
        async with self._lock:
            try:
                async with asyncio.timeout(WRITE_TIMEOUT_S) as deadline:
                    progress = _ProgressWatch(deadline, self._unsent)
                    try:
                        await self.response.write(data)
                        if eof:
                            await self.response.write_eof()
                    finally:
                        progress.stop()
            except TimeoutError:
                raise ConnectionResetError(
                    f"the client took no data for {WRITE_TIMEOUT_S:g} s"
                ) from None
            self._ended = self._ended or eof
            self._last_write_s = time.monotonic()

    async def write_quietly(self, data: bytes, eof: bool = False) -> bool:
        """Write (and end the response if `eof`) if the client is still there; False if
        gone (or not reading)."""
        try:
            await self.write(data, eof)
        except ConnectionResetError:
            return False
        return True

    async def keep_alive(self) -> None:
        """Until cancelled, the response ends or its client is gone."""
        while not self._ended:
            idle_s = time.monotonic() - self._last_write_s
            if idle_s < KEEPALIVE_S:
                await asyncio.sleep(KEEPALIVE_S - idle_s)
            elif not await self.write_quietly(KEEPALIVE_COMMENT):
                return


class _ProgressWatch:
    """Pushes a waiting write's deadline WRITE_TIMEOUT_S on whenever its client has taken
    bytes since the last look (every PROGRESS_CHECK_S): a timer, not a task, as most
    writes finish at once."""

    def __init__(self, deadline: asyncio.Timeout, unsent: Callable[[], int]) -> None:
        self._deadline = deadline
        self._unsent = unsent
        self._last_unsent: int | None = None
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(PROGRESS_CHECK_S, self._look)

    def _look(self) -> None:
        unsent = self._unsent()
        progressed = self._last_unsent is not None and unsent < self._last_unsent
        if progressed and not self._deadline.expired():
            self._deadline.reschedule(self._loop.time() + WRITE_TIMEOUT_S)
        self._last_unsent = unsent
        self._timer = self._loop.call_later(PROGRESS_CHECK_S, self._look)

    def stop(self) -> None:
        self._timer.cancel()
