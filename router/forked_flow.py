"""`n > 1`: n sequences of one request from a single prefill, as one stream of chunks.

Disaggregated pair: one `Prefill` with `num_sequences = n`. The prefill worker computes
the prompt once, samples sequence 0's first token, and holds the same KV blocks once
per sequence (shared, each with its own lease and release). Then n `Decode` calls run
side by side: sequence 0 continues from its first token; sequence i pulls its own handle
and samples its first token on the decode worker (which recomputes the last prompt
position: one token, not a prefill). The decode side holds a copy of the prompt's KV
per sequence: the pulls are n, the prefill is one.

Local prefill (no prefill worker in the pair, or the first token already ended sequence
0): the first local sequence prefills on the decode worker; the others start after its
first token, so they find the prompt's full blocks in that worker's prefix cache.

Only the first attempt is shared: each sequence is driven by `SequenceFlow.run`, so a
worker failure migrates each sequence on its own (placed under its own policy key,
`req#i`), keeping the tokens it already sent. A failed shared prefill migrates every
sequence. Every chunk carries its sequence's `index`. Seeded requests give sequence i
the seed `seed + i`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator

from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.router.attempts import Attempt, AttemptFailed
from tandem.router.chunk_stream import GenerationChunk
from tandem.router.policy import Placement
from tandem.router.sequence import Sequence
from tandem.router.sequence_flow import Chunks, SequenceFlow
from tandem.router.worker_pool import WorkerPair
from tandem.worker.convert import sampling_params_to_proto


async def generate_forked(
    flow: SequenceFlow, sequences: list[Sequence], placement: Placement
) -> Chunks:
    """The chunks of all sequences, interleaved as they come (see the module doc).
    `placement` is the request's (charged for all n sequences; the caller frees it)."""
    start = _SharedStart(flow, sequences, placement)
    await start.prefill()
    merged = _Merged()
    try:
        for seq in sequences:
            merged.start(seq.index, flow.run(seq, placement, start.first_attempt))
        async with contextlib.aclosing(merged.chunks()) as chunks:
            async for chunk in chunks:
                yield chunk
    finally:
        await merged.close()
        await start.release_unclaimed()


class _SharedStart:
    """The one prefill of a forked request, and each sequence's first attempt from it."""

    def __init__(self, flow: SequenceFlow, sequences: list[Sequence], placement: Placement) -> None:
        self.flow = flow
        self.sequences = sequences
        self.placement = placement
        self.pair: WorkerPair | None = None
        # Why the shared start failed (every sequence then migrates, or fails, with it).
        self.failure: AttemptFailed | None = None
        # Sequence 0's first token, from the prefill worker.
        self.first: GenerationChunk | None = None
        self.first_token_id = 0
        # KV handles the prefill worker holds for sequences not yet decoding, by index.
        self.unclaimed: dict[int, pb.KvHandle] = {}
        # Sequences that prefill on the decode worker; the first of them goes first.
        self.local: list[int] = []
        # Set once the first local sequence has its first token (or ended).
        self.cache_warm = asyncio.Event()

    async def prefill(self) -> None:
        lead = self.sequences[0]
        attempt = self.flow.attempts.begin(self.placement)
        try:
            self.pair = self.flow.pair_of(self.placement)
            if self.pair.prefill_stub is None:
                self.local = [seq.index for seq in self.sequences]
                return
            request = pb.PrefillRequest(
                request_id=lead.req_id,
                prompt_token_ids=lead.prompt_ids,
                params=sampling_params_to_proto(lead.params),
                num_sequences=len(self.sequences),
            )
            response = await self.flow.calls.prefill(self.pair, request, lead.span, attempt)
        except AttemptFailed as failure:
            self.failure = failure
            return
        finally:
            self.flow.attempts.end(attempt)
        num_prompt_tokens = len(lead.prompt_ids)
        self.first = self.flow.prefilled(lead, lead.params, self.pair, response, num_prompt_tokens)
        if self.first.finish_reason is None:  # the KV is held once per sequence
            handles = [response.kv_handle, *response.sequence_kv_handles]
            self.unclaimed = dict(enumerate(handles))
            self.first_token_id = response.first_token_id
        else:
            self.local = [seq.index for seq in self.sequences[1:]]

    async def first_attempt(self, seq: Sequence, attempt: Attempt) -> Chunks:
        """Sequence `seq`'s part of the shared start (`FirstAttempt` of `SequenceFlow`)."""
        if self.failure is not None:
            f = self.failure
            raise AttemptFailed(f.worker_id, f.reason, f.error, f.migratable) from f.__cause__
        assert self.pair is not None  # set whenever there is no failure
        if seq.index == 0 and self.first is not None and self.first.finish_reason is not None:
            yield self.first
            return
        request = pb.DecodeRequest(
            request_id=seq.req_id,
            prompt_token_ids=seq.prompt_ids,
            params=sampling_params_to_proto(seq.params),
        )
        if seq.index in self.local:
            chunks = self._local(request, seq, attempt)
        else:
            request.kv_handle.CopyFrom(self.unclaimed.pop(seq.index))
            first = None
            if seq.index == 0:
                request.first_token_id, first = self.first_token_id, self.first
            else:
                request.sample_first_token = True
            chunks = self.flow.decode_held(self.pair, request, seq, attempt, first)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    async def _local(self, request: pb.DecodeRequest, seq: Sequence, attempt: Attempt) -> Chunks:
        assert self.pair is not None
        request.local_prefill = True
        leads = seq.index == self.local[0]
        if not leads:
            # Bounded: the lead's decode call has the request timeout, and its end sets it.
            await self.cache_warm.wait()
        try:
            async with contextlib.aclosing(
                self.flow.decode_local(self.pair, request, seq, attempt)
            ) as chunks:
                async for chunk in chunks:
                    if leads:  # its prompt's full blocks are cached on the decode worker now
                        self.cache_warm.set()
                    yield chunk
        finally:
            if leads:
                self.cache_warm.set()

    async def release_unclaimed(self) -> None:
        """Unpin the KV of sequences that never started decoding from it."""
        if self.pair is not None:
            for handle in self.unclaimed.values():
                await self.flow.calls.release(self.pair, handle.request_id)
        self.unclaimed.clear()


_DONE = object()


class _Merged:
    """Several sequences' chunk streams run as tasks, merged into one as they come."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []

    def start(self, index: int, chunks: Chunks) -> None:
        self.tasks.append(asyncio.create_task(self._pump(index, chunks)))

    async def _pump(self, index: int, chunks: Chunks) -> None:
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    self.queue.put_nowait(dataclasses.replace(chunk, index=index))
            self.queue.put_nowait(_DONE)
        except Exception as exc:  # handed to the consumer, never swallowed
            self.queue.put_nowait(exc)

    async def chunks(self) -> AsyncGenerator[GenerationChunk, None]:
        """Every sequence's chunks until all ended; the first error ends the stream."""
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
