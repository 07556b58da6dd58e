"""What a request's stream carries to the APIs, the task-owning stream itself, and the
merge of several such streams into one (a request's `n` sequences, a batch's prompts)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from tandem.engine.outputs import PromptLogprobs
from tandem.engine.request import FinishReason
from tandem.engine.sampler import TopLogprobs


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass
class GenerationChunk:
    """New tokens of a request, in the order the client sees them."""

    token_ids: list[int]
    text: str
    logprobs: list[float] = field(default_factory=list)
    # STOP, LENGTH or ABORT on the last chunk; None before.
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    # Which of the request's `n` sequences (choices) the tokens belong to.
    index: int = 0
    # With the first token when asked (SamplingParams.prompt_logprobs).
    prompt_logprobs: PromptLogprobs | None = None
    # One per token when asked (SamplingParams.top_logprobs > 0): the most likely tokens
    # at its position.
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # With STOP: the stop token id or stop string that ended the sequence (vLLM's
    # stop_reason); None for EOS and a finished grammar.
    stop_reason: int | str | None = None


_END = object()


def public_finish_reason(reason: FinishReason | None) -> str | None:
    """The string the public APIs (OpenAI, KServe) put in `finish_reason`."""
    return None if reason is None else reason.value


class ChunkStream:
    """An async iterator of one request's chunks, produced by a task it owns.

    Iterating starts the task. `cancel()` / `aclose()` (or cancelling the consumer while
    it waits for a chunk) cancels the task, which cancels the worker calls in flight.
    API handlers must close the stream when they exit, however they exit.
    """

    def __init__(self, source: AsyncGenerator[GenerationChunk, None]) -> None:
        self._source = source
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._cancel_requested = False

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._pump())
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def _pump(self) -> None:
        try:
            async for chunk in self._source:
                self._queue.put_nowait(chunk)
            self._queue.put_nowait(_END)
        except Exception as exc:  # handed to the consumer, never swallowed
            self._queue.put_nowait(exc)

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
        self.queue: asyncio.Queue[object] = asyncio.Queue()
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
                    self.queue.put_nowait(chunk)
            self.queue.put_nowait(_DONE)
        except Exception as exc:  # handed to the consumer, never swallowed
            self.queue.put_nowait(exc)

    async def chunks(self) -> AsyncGenerator[GenerationChunk, None]:
        """Every stream's chunks until all ended; the first error ends the merge."""
        num_open = len(self.tasks)
        while num_open:
            item = await self.queue.get()
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
