"""One request through the cluster: prefill worker, then decode worker, as one stream.

The first token is yielded as soon as the prefill worker returns it (TTFT never waits
for the KV transfer). Cancelling the consumer cancels the worker calls, and the
workers free what they hold; a prefill whose handle is never used is released here
(its lease is the backstop if even that fails).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from opentelemetry.trace import Span

from engine.sampling_params import SamplingParams
from engine.tracing import Tracing
from proto.convert import FINISH_REASON_NAMES, sampling_params_to_proto
from proto.tandem.worker.v1 import worker_pb2 as pb
from router.errors import from_worker_error
from router.metrics import RequestRecord, RouterMetrics
from router.worker_pool import WorkerPair, WorkerPool

logger = logging.getLogger(__name__)

_RELEASE_TIMEOUT_S = 5.0


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
    # "stop", "length" or "abort" on the last chunk; None before.
    finish_reason: str | None = None
    usage: Usage | None = None


_END = object()


class ChunkStream:
    """An async iterator of one request's chunks, produced by a task it owns.

    Iterating starts the task. `cancel()` / `aclose()` (or cancelling the consumer while
    it waits for a chunk) cancels the task, which cancels the worker calls in flight.
    API handlers must close the stream when they exit, however they exit.
    """

    def __init__(self, source: AsyncIterator[GenerationChunk]) -> None:
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
        if self._task is None:
            # Never started: nothing is held yet; close the source so it cannot start.
            self._task = asyncio.get_running_loop().create_task(self._source.aclose())
        elif not self._task.done() and not self._cancel_requested:
            # Once: a second cancel would interrupt the request's own cleanup.
            self._cancel_requested = True
            self._task.cancel()

    async def aclose(self) -> None:
        """Cancel the request (if still running) and wait for its cleanup."""
        self.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


class RequestFlow:
    """Runs requests over a worker pool; stateless between requests."""

    def __init__(
        self,
        pool: WorkerPool,
        metrics: RouterMetrics,
        tracing: Tracing,
        prefill_timeout_s: float,
        request_timeout_s: float,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.tracing = tracing
        self.prefill_timeout_s = prefill_timeout_s
        self.request_timeout_s = request_timeout_s

    def generate(self, req_id: str, prompt_ids: list[int], params: SamplingParams) -> ChunkStream:
        """The request's chunks; worker failures surface as `RouterError`s.

        The request runs in a task the returned stream owns, so cancelling or closing the
        stream stops it wherever it is (worker calls cancelled, held KV released).
        """
        return ChunkStream(self._traced(req_id, prompt_ids, params))

    async def _traced(
        self, req_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        record = self.metrics.record(len(prompt_ids))
        span = self.tracing.start_span(
            "tandem.request",
            **{
                "tandem.request_id": req_id,
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.usage.input_tokens": len(prompt_ids),
            },
        )
        reason = "abort"
        try:
            async for chunk in self._generate(req_id, prompt_ids, params, record, span):
                record.on_tokens(len(chunk.token_ids))
                if chunk.finish_reason is not None:
                    reason = chunk.finish_reason
                yield chunk
        except grpc.aio.AioRpcError as exc:
            reason = "error"
            raise from_worker_error(exc) from exc
        finally:
            record.finish(reason)
            span.set_attribute("gen_ai.response.finish_reasons", [reason])
            span.set_attribute("gen_ai.usage.output_tokens", record.num_tokens)
            span.end()

    async def _generate(
        self,
        req_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        record: RequestRecord,
        span: Span,
    ) -> AsyncIterator[GenerationChunk]:
        queue_span = self.tracing.start_span("queue", span)
        pair = self.pool.next_pair()
        queue_span.end()
        decision = "disaggregated" if pair.prefill is not None else "local_prefill"
        self.metrics.disagg_decisions.labels(self.metrics.model_name, decision).inc()
        usage = Usage(prompt_tokens=len(prompt_ids))
        wire_params = sampling_params_to_proto(params)
        decode_request = pb.DecodeRequest(
            request_id=req_id, prompt_token_ids=prompt_ids, params=wire_params
        )
        if pair.prefill_stub is not None:
            prefill = await self._prefill(pair, req_id, prompt_ids, wire_params, span)
            usage.completion_tokens = 1
            usage.cached_prompt_tokens = prefill.num_cached_tokens
            finish = FINISH_REASON_NAMES[prefill.finish_reason]
            first = GenerationChunk(
                [prefill.first_token_id],
                prefill.first_token_text,
                [prefill.first_token_logprob] if params.logprobs else [],
            )
            if finish is not None:
                first.finish_reason, first.usage = finish, usage
                yield first
                return
            decode_request.kv_handle.CopyFrom(prefill.kv_handle)
            decode_request.first_token_id = prefill.first_token_id
        decode_span = self.tracing.start_span(
            "decode", span, **{"tandem.worker": pair.decode.worker_id}
        )
        try:
            if pair.prefill_stub is not None:
                yield first
            async for chunk in self._decode(
                pair, decode_request, usage, params.logprobs, record, decode_span
            ):
                yield chunk
        except BaseException:
            if pair.prefill_stub is not None:
                # The decode side may never have pulled: unpin (a no-op if it did).
                await self._release(pair, req_id)
            raise
        finally:
            decode_span.end()

    async def _prefill(
        self,
        pair: WorkerPair,
        req_id: str,
        prompt_ids: list[int],
        params: pb.SamplingParams,
        parent: Span,
    ) -> pb.PrefillResponse:
        request = pb.PrefillRequest(request_id=req_id, prompt_token_ids=prompt_ids, params=params)
        span = self.tracing.start_span(
            "prefill", parent, **{"tandem.worker": pair.prefill.worker_id}
        )
        try:
            return await pair.prefill_stub.Prefill(
                request, timeout=self.prefill_timeout_s, metadata=self.tracing.metadata(span)
            )
        finally:
            span.end()

    async def _decode(
        self,
        pair: WorkerPair,
        request: pb.DecodeRequest,
        usage: Usage,
        logprobs: bool,
        record: RequestRecord,
        span: Span,
    ) -> AsyncIterator[GenerationChunk]:
        call = pair.decode_stub.Decode(
            request, timeout=self.request_timeout_s, metadata=self.tracing.metadata(span)
        )
        try:
            async for msg in call:
                usage.completion_tokens += len(msg.token_ids)
                if not request.HasField("kv_handle"):
                    usage.cached_prompt_tokens = msg.num_cached_tokens
                finish = FINISH_REASON_NAMES[msg.finish_reason]
                if msg.timings.transfer_s > 0:
                    record.on_kv_transfer(msg.timings.transfer_s)
                yield GenerationChunk(
                    list(msg.token_ids),
                    msg.text,
                    list(msg.logprobs) if logprobs else [],
                    finish,
                    usage if finish is not None else None,
                )
                if finish is not None:
                    return
        finally:
            # Client gone or finished early: the decode worker aborts on cancellation.
            call.cancel()

    async def _release(self, pair: WorkerPair, req_id: str) -> None:
        """Unpin a prefill nobody will pull (cancelled between prefill and decode)."""
        try:
            await asyncio.shield(
                pair.prefill_stub.Release(
                    pb.ReleaseRequest(request_id=req_id), timeout=_RELEASE_TIMEOUT_S
                )
            )
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            logger.info("release of %s failed (%s); its lease will expire", req_id, exc)
