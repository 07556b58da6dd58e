"""The task-owning stream of a request's chunks, and the merge of several such streams
into one (a request's `n` sequences, a batch's prompts). Both hand chunks to their
consumer through a `ChunkBuffer`, so a consumer that lags gets them joined."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator

from tandem.router.chunk_buffer import ChunkBuffer
from tandem.router.generation_chunk import GenerationChunk

_END = object()


class ChunkStream:
    """An async iterator of one request's chunks, produced by a task it owns.

    Iterating starts the task. `cancel()` / `aclose()` (or cancelling the consumer while
    it waits for a chunk) cancels the task, which cancels the worker calls in flight.
    API handlers must close the stream when they exit, however they exit.
    """

    def __init__(self, source: AsyncGenerator[GenerationChunk, None]) -> None:
        self._source = source
        self._buffer = ChunkBuffer()
        self._task: asyncio.Task | None = None
        self._cancel_requested = False

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._pump())
        try:
            item = await self._buffer.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, GenerationChunk)
        return item

    async def _pump(self) -> None:
        try:
            async for chunk in self._source:
                self._buffer.put(chunk)
            self._buffer.put(_END)
        except Exception as exc:  # handed to the consumer, never swallowed
            self._buffer.put(exc)

    def cancel(self) -> None:
        self._cancel()

    def _cancel(self) -> asyncio.Task:
        """Cancels the request; returns the task whose end is the end of its cleanup."""
        if self._task is None:
            # Never started: nothing is held yet; close the source so it cannot start.
            self._task = asyncio.get_running_loop().create_task(self._source.aclose())
        elif not self._task.done() and not self._cancel_requested:
            # Once: a second cancel would interrupt the request's own cleanup.
            self._cancel_requested = True
            self._task.cancel()
        return self._task

    async def aclose(self) -> None:
        """Cancel the request (if still running) and wait for its cleanup."""
        await asyncio.gather(self._cancel(), return_exceptions=True)


# A stream MergedChunks runs: a generator, or a ChunkStream (both close with aclose()).
ClosableChunks = AsyncGenerator[GenerationChunk, None] | ChunkStream

_DONE = object()


class MergedChunks:
    """Several chunk streams run as tasks, merged into one as their chunks come.

    Whoever starts streams here must `close()` it on every exit: that cancels the tasks,
    and each task closes its stream (cancelling the worker calls behind it).
    """

    def __init__(self) -> None:
        self._buffer = ChunkBuffer()
        self.tasks: list[asyncio.Task] = []

    def start(self, chunks: ClosableChunks, first_index: int = 0) -> None:
        """Runs `chunks`; their chunks come out with `index` shifted by `first_index`."""
        self.tasks.append(asyncio.create_task(self._pump(chunks, first_index)))

    async def _pump(self, chunks: ClosableChunks, first_index: int) -> None:
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if first_index:
                        chunk = dataclasses.replace(chunk, index=first_index + chunk.index)
                    self._buffer.put(chunk)
            self._buffer.put(_DONE)
        except Exception as exc:  # handed to the consumer, never swallowed
            self._buffer.put(exc)

    async def chunks(self) -> AsyncGenerator[GenerationChunk, None]:
        """Every stream's chunks until all ended; the first error ends the merge."""
        num_open = len(self.tasks)
        while num_open:
            item = await self._buffer.get()
            if isinstance(item, BaseException):
                raise item
            if item is _DONE:
                num_open -= 1
                continue
            assert isinstance(item, GenerationChunk)
            yield item

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
