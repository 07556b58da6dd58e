"""`n > 1`: n sequences of one request from a single prefill, as one stream of chunks.

Disaggregated pair: one `Prefill` with `num_sequences = n`. The prefill worker computes
the prompt once, samples sequence 0's first token, and holds the same KV blocks once
per sequence (shared, each with its own lease and release). Then n `Decode` calls run
side by side: sequence 0 continues from its first token; sequence i pulls its own handle
and samples its first token on the decode worker (which recomputes the last prompt
position: one token, not a prefill). The decode side holds a copy of the prompt's KV
per sequence: the pulls are n, the prefill is one.

Local prefill (no prefill worker in the pair, or the first token already ended sequence
0): sequence 0 prefills on the decode worker; the others start after its first token,
so they find the prompt's full blocks in that worker's prefix cache.

Every chunk carries its sequence's `index`. Seeded requests give sequence i the seed
`seed + i`. Not migrated: a worker failure ends the request with its error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

import grpc

from tandem.engine.sampling_params import SamplingParams
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.router.chunk_stream import GenerationChunk, Usage
from tandem.router.errors import from_worker_error
from tandem.router.policy import RequestSlo
from tandem.worker.convert import finish_reason_from_proto, sampling_params_to_proto

if TYPE_CHECKING:
    from tandem.router.metrics import RequestRecord
    from tandem.router.request_flow import RequestFlow, _Attempt
    from tandem.router.worker_pool import WorkerPair

_MAX_SEED = 2**64


def sequence_id(req_id: str, index: int) -> str:
    """The worker-side request id of sequence `index` (0 keeps the request's own)."""
    return req_id if index == 0 else f"{req_id}#{index}"


def sequence_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index`'s params: its own seed; prompt logprobs only from sequence 0."""
    if index == 0:
        return params
    seed = None if params.seed is None else (params.seed + index) % _MAX_SEED
    return dataclasses.replace(params, seed=seed, prompt_logprobs=False)


async def generate_forked(
    flow: RequestFlow,
    req_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    slo: RequestSlo,
    n: int,
) -> AsyncGenerator[GenerationChunk, None]:
    """The chunks of all n sequences, interleaved as they come (see the module doc)."""
    from tandem.router.request_flow import _AttemptFailed, _lost

    span = flow.tracing.start_span("tandem.request", None, **{"tandem.request_id": req_id})
    # The decode worker holds n copies of prompt + output: charge the placement that.
    num_charged = n * (len(prompt_ids) + params.max_tokens) - len(prompt_ids)
    charged = dataclasses.replace(params, max_tokens=num_charged)
    placement = await flow._place(req_id, prompt_ids, charged, slo, span)
    record = flow.metrics.record(len(prompt_ids), slo.slo.ttft_s, slo.slo.itl_s)
    flow.metrics.disagg_decisions.labels(flow.metrics.model_name, placement.decision).inc()
    run = _Sequences(flow, req_id, params, record, Usage(prompt_tokens=len(prompt_ids)))
    attempts = [flow._begin(placement) for _ in range(n)]
    reason = "abort"  # a metrics / span label: stays "abort" if the client leaves
    last_reason = "stop"
    pair: WorkerPair | None = None
    try:
        try:
            pair = flow.pool.pair(placement.prefill_worker_id, placement.decode_worker_id)
        except KeyError as exc:
            raise _lost(str(exc.args[0])).error from None
        requests = [
            pb.DecodeRequest(
                request_id=sequence_id(req_id, i),
                prompt_token_ids=prompt_ids,
                params=sampling_params_to_proto(sequence_params(params, i)),
            )
            for i in range(n)
        ]
        local = list(range(n))  # sequences that prefill on the decode worker
        if pair.prefill_stub is not None:
            prefill = await flow._prefill(
                pair, req_id, prompt_ids, requests[0].params, span, attempts[0], n
            )
            flow.policy.on_prefill_done(
                req_id, num_cached_tokens=prefill.num_cached_tokens,
                compute_s=prefill.timings.compute_s,
            )  # fmt: skip
            run.usage.cached_prompt_tokens = prefill.num_cached_tokens
            finish = finish_reason_from_proto(prefill.finish_reason)
            run.queue.put_nowait(
                GenerationChunk(
                    [prefill.first_token_id],
                    prefill.first_token_text,
                    [prefill.first_token_logprob] if params.logprobs else [],
                    finish,
                    prompt_logprobs=list(prefill.prompt_logprobs) or None,
                )
            )
            local = local[1:]
            if finish is None:  # the KV is held once per sequence
                handles = [prefill.kv_handle, *prefill.sequence_kv_handles]
                run.held = [h.request_id for h in handles]
                for i, (request, handle) in enumerate(zip(requests, handles, strict=True)):
                    request.kv_handle.CopyFrom(handle)
                    if i == 0:
                        request.first_token_id = prefill.first_token_id
                    else:
                        request.sample_first_token = True
                    run.start(pair, request, i, attempts[i])
                local = []
        for i in local:
            requests[i].local_prefill = True
        if local:
            run.start(pair, requests[local[0]], local[0], attempts[local[0]])
        num_open = n
        while num_open:
            item = await run.queue.get()
            if isinstance(item, BaseException):
                raise item
            if local and item.index == local[0]:
                # Its prompt's full blocks are cached on the decode worker now.
                for i in local[1:]:
                    run.start(pair, requests[i], i, attempts[i])
                local = []
            run.usage.completion_tokens += len(item.token_ids)
            record.on_tokens(len(item.token_ids))
            if item.finish_reason is not None:
                num_open -= 1
                item.usage = run.usage
                last_reason = item.finish_reason.value
            yield item
        reason = last_reason
    except _AttemptFailed as failure:  # a worker call failed: no migration for n > 1
        reason = "error"
        raise failure.error from failure.__cause__
    except grpc.aio.AioRpcError as exc:
        reason = "error"
        raise from_worker_error(exc) from exc
    finally:
        await run.close(pair)
        for attempt in attempts:
            flow._end(attempt)
        flow.policy.on_finish(req_id)
        record.finish(reason)
        span.end()


class _Sequences:
    """The decode calls of one forked request, feeding one queue."""

    def __init__(
        self,
        flow: RequestFlow,
        req_id: str,
        params: SamplingParams,
        record: RequestRecord,
        usage: Usage,
    ) -> None:
        self.flow = flow
        self.req_id = req_id
        self.params = params
        self.record = record
        self.usage = usage
        self.queue: asyncio.Queue[GenerationChunk | BaseException] = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        # Worker-side ids of KV the prefill worker holds for us.
        self.held: list[str] = []

    def start(
        self, pair: WorkerPair, request: pb.DecodeRequest, index: int, attempt: _Attempt
    ) -> None:
        self.tasks.append(asyncio.create_task(self._stream(pair, request, index, attempt)))

    async def _stream(
        self, pair: WorkerPair, request: pb.DecodeRequest, index: int, attempt: _Attempt
    ) -> None:
        span = self.flow.tracing.start_span("decode", None, **{"tandem.sequence": index})
        chunks = self.flow._decode(
            pair, request, self.usage, self.params.logprobs, self.record, span, attempt, index == 0
        )
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    self.queue.put_nowait(dataclasses.replace(chunk, index=index, usage=None))
        except Exception as exc:  # handed to the consumer, never swallowed
            self.queue.put_nowait(exc)
        finally:
            span.end()

    async def close(self, pair: WorkerPair | None) -> None:
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        if pair is not None and pair.prefill_stub is not None:
            for held_id in self.held:  # a no-op for each one a decode worker pulled
                await self.flow._release(pair, held_id)
        self.flow.policy.on_kv_pulled(self.req_id)
