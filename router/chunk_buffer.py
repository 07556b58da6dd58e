"""The chunks between a request's producer and a consumer that may lag behind it.

A sequence's chunks that wait for the consumer join into one: a chunk that comes while
an earlier one of the same sequence (`index`) still waits is appended to it, and the
consumer gets them as one chunk (their tokens, text, logprobs in order). A client that
reads slower than the model writes (a slow network, a big `n` with `logprobs`) then
gets fewer, larger events, each with one envelope, and catches up, instead of a backlog
of one-token events each carrying its own (as vLLM's output collector merges the
outputs its consumer has not taken yet). The sequences' order between each other is
not kept (a later sequence's chunk may go out first); each sequence's own order is.
"""

from __future__ import annotations

import asyncio
import collections

from tandem.router.generation_chunk import GenerationChunk

# Chunks of one sequence, in order, that the consumer has not taken yet.
_Run = list[GenerationChunk]


class ChunkBuffer:
    """A queue of chunks and other items (end markers, errors), unbounded, whose waiting
    chunks join per sequence (see the module doc). One producer, one consumer."""

    def __init__(self) -> None:
        self._items: collections.deque[_Run | object] = collections.deque()
        # The run still waiting in `_items` of each sequence that has one.
        self._waiting: dict[int, _Run] = {}
        self._ready = asyncio.Event()

    def put(self, item: object) -> None:
        if isinstance(item, GenerationChunk):
            run = self._waiting.get(item.index)
            if run is not None:
                run.append(item)
                return
            self._waiting[item.index] = run = [item]
            self._items.append(run)
        else:
            self._items.append(item)
        self._ready.set()

    async def get(self) -> object:
        """The next item; a sequence's waiting chunks as one."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, list):
            del self._waiting[item[0].index]
            return joined(item)
        return item


def joined(chunks: list[GenerationChunk]) -> GenerationChunk:
    """Consecutive chunks of one sequence as one chunk."""
    if len(chunks) == 1:
        return chunks[0]
    first, last = chunks[0], chunks[-1]
    return GenerationChunk(
        token_ids=[t for chunk in chunks for t in chunk.token_ids],
        text="".join(chunk.text for chunk in chunks),
        logprobs=[lp for chunk in chunks for lp in chunk.logprobs],
        finish_reason=last.finish_reason,
        usage=next((c.usage for c in reversed(chunks) if c.usage is not None), None),
        index=first.index,
        prompt_logprobs=first.prompt_logprobs,
        top_logprobs=[top for chunk in chunks for top in chunk.top_logprobs],
        stop_reason=last.stop_reason,
    )
