"""`n > 1`: n sequences of one request from a single prefill, as one stream of chunks.

Disaggregated pair: one `Prefill`, and one KV pull. Sequence 0 decodes from the
prefill worker's handle, after its first token; once its decode worker has imported the
prompt's KV (its first decode chunk), sequences 1..n-1 start on that worker with
`local_prefill`: the prompt's full blocks are in its prefix cache, so each recomputes at
most its last block and samples its own first token. The decode side holds the prompt's
full blocks once, shared by the n sequences (as the prefix cache shares them).

Local prefill (no prefill worker in the pair, or the first token already ended sequence
0): the first local sequence prefills on the decode worker; the others start after its
first token, so they find the prompt's full blocks in that worker's prefix cache.

Either way one sequence leads: the others wait for its first chunk from the decode
worker (or its end), so a cache eviction in between costs a local recompute, never a
wrong token. Only the first attempt is shared: each sequence is driven by
`SequenceFlow.run`, so a worker failure migrates each sequence on its own (placed under
its own policy key, `req#i`), keeping the tokens it already sent. A failed shared
prefill migrates every sequence. Every chunk carries its sequence's `index`. Seeded
requests give sequence i the seed `seed + i`.
"""

from __future__ import annotations

import asyncio
import contextlib

from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.router.attempts import Attempt, AttemptFailed
from tandem.router.chunk_stream import MergedChunks
from tandem.router.generation_chunk import GenerationChunk
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
    merged = MergedChunks()
    try:
        for seq in sequences:
            merged.start(flow.run(seq, placement, start.first_attempt), first_index=seq.index)
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
        # The prefill worker's KV of the prompt until sequence 0's decode claims it.
        self.unclaimed: pb.KvHandle | None = None
        # The sequence whose start fills the decode worker's prefix cache (see above).
        self.leader = 0
        # Set once the leader has its first chunk from the decode worker (or ended).
        self.cache_warm = asyncio.Event()

    async def prefill(self) -> None:
        lead = self.sequences[0]
        attempt = self.flow.attempts.begin(self.placement)
        try:
            self.pair = self.flow.pair_of(self.placement)
            if self.pair.prefill_stub is None:
                return  # every sequence prefills locally, sequence 0 first
            request = pb.PrefillRequest(
                request_id=lead.req_id,
                prompt_token_ids=lead.prompt_ids,
                params=sampling_params_to_proto(lead.params),
            )
            response = await self.flow.calls.prefill(self.pair, request, lead.span, attempt)
        except AttemptFailed as failure:
            self.failure = failure
            return
        finally:
            self.flow.attempts.end(attempt)
        num_prompt_tokens = len(lead.prompt_ids)
        self.first = self.flow.prefilled(lead, lead.params, self.pair, response, num_prompt_tokens)
        if self.first.finish_reason is None:  # sequence 0 pulls the KV and leads
            self.unclaimed = response.kv_handle
        else:  # no KV is held: sequence 1 prefills locally and leads
            self.leader = 1

    async def first_attempt(self, seq: Sequence, attempt: Attempt) -> Chunks:
        """Sequence `seq`'s part of the shared start (`FirstAttempt` of `SequenceFlow`)."""
        if self.failure is not None:
            f = self.failure
            raise AttemptFailed(
                f.worker_id, f.reason, f.error, f.migratable, f.engine_step_failed
            ) from f.__cause__
        assert self.pair is not None  # set whenever there is no failure
        leads = seq.index == self.leader
        if seq.index == 0 and not leads:  # its first token ended it at the prefill
            assert self.first is not None
            yield self.first
            return
        if not leads:
            # Bounded: the leader's decode call has the request timeout, and its end sets it.
            await self.cache_warm.wait()
        request = pb.DecodeRequest(
            request_id=seq.req_id,
            prompt_token_ids=seq.prompt_ids,
            params=sampling_params_to_proto(seq.params),
        )
        # Chunks before the decode worker's first one: the prefill's first token.
        num_from_prefill = 0
        if seq.index == 0 and self.unclaimed is not None:
            request.kv_handle.CopyFrom(self.unclaimed)
            assert self.first is not None  # set with the handle
            request.first_token_id = self.first.token_ids[0]
            self.unclaimed = None  # decode_held releases it if the decode never pulls
            chunks = self.flow.decode_held(self.pair, request, seq, attempt, self.first)
            num_from_prefill = 1
        else:
            request.local_prefill = True
            chunks = self.flow.decode_local(self.pair, request, seq, attempt)
        try:
            num_chunks = 0
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if leads and num_chunks >= num_from_prefill:  # the prompt is cached
                        self.cache_warm.set()
                    num_chunks += 1
                    yield chunk
        finally:
            if leads:
                self.cache_warm.set()

    async def release_unclaimed(self) -> None:
        """Unpin the prompt's KV if sequence 0 never started decoding from it."""
        if self.pair is not None and self.unclaimed is not None:
            await self.flow.calls.release(self.pair, self.unclaimed.request_id)
        self.unclaimed = None
