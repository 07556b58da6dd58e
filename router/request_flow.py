"""One request through the cluster: prefill worker, then decode worker, as one stream.

The first token is yielded as soon as the prefill worker returns it (TTFT never waits
for the KV transfer). Cancelling the consumer cancels the worker calls, and the
workers free what they hold; a prefill whose handle is never used is released here
(its lease is the backstop if even that fails).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
from opentelemetry.trace import Span

from tandem.engine.request import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.router.chunk_stream import ChunkStream, GenerationChunk, Usage
from tandem.router.errors import Overloaded, from_worker_error
from tandem.router.metrics import RequestRecord, RouterMetrics
from tandem.router.policy import GoodputPolicy, Placement, RequestSlo, SloConfig
from tandem.router.worker_pool import WorkerPair, WorkerPool
from tandem.telemetry.tracing import Tracing
from tandem.worker.convert import finish_reason_from_proto, sampling_params_to_proto

logger = logging.getLogger(__name__)

_RELEASE_TIMEOUT_S = 5.0


__all__ = ["ChunkStream", "GenerationChunk", "RequestFlow", "Usage"]


class RequestFlow:
    """Runs requests over a worker pool, placed by the goodput policy."""

    def __init__(
        self,
        pool: WorkerPool,
        policy: GoodputPolicy,
        slo: SloConfig,
        metrics: RouterMetrics,
        tracing: Tracing,
        prefill_timeout_s: float,
        request_timeout_s: float,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.slo = slo
        self.metrics = metrics
        self.tracing = tracing
        self.prefill_timeout_s = prefill_timeout_s
        self.request_timeout_s = request_timeout_s

    def generate(
        self,
        req_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        slo: RequestSlo | None = None,
    ) -> ChunkStream:
        """The request's chunks; a shed request raises `Overloaded`, worker failures
        other `RouterError`s. `slo` None = the default class.

        The request runs in a task the returned stream owns, so cancelling or closing the
        stream stops it wherever it is (worker calls cancelled, held KV released).
        """
        return ChunkStream(self._traced(req_id, prompt_ids, params, slo or self.slo.resolve()))

    async def _traced(
        self, req_id: str, prompt_ids: list[int], params: SamplingParams, slo: RequestSlo
    ) -> AsyncGenerator[GenerationChunk, None]:
        span = self.tracing.start_span(
            "tandem.request",
            None,  # a root span
            **{
                "tandem.request_id": req_id,
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.usage.input_tokens": len(prompt_ids),
            },
        )
        placement = await self._place(req_id, prompt_ids, params, slo, span)
        record = self.metrics.record(len(prompt_ids), slo.slo.ttft_s, slo.slo.itl_s)
        self.metrics.disagg_decisions.labels(self.metrics.model_name, placement.decision).inc()
        reason = FinishReason.ABORT.value
        output_ids: list[int] = []
        placed_at = time.monotonic()
        try:
            chunks = self._generate(req_id, prompt_ids, params, placement, record, span)
            async for chunk in chunks:
                if not output_ids and chunk.token_ids:
                    self.policy.observe_ttft(req_id, time.monotonic() - placed_at)
                record.on_tokens(len(chunk.token_ids))
                output_ids += chunk.token_ids
                if chunk.finish_reason is not None:
                    reason = chunk.finish_reason.value  # a metrics / span label
                yield chunk
        except grpc.aio.AioRpcError as exc:
            reason = "error"
            raise from_worker_error(exc) from exc
        finally:
            self.policy.on_finish(req_id, output_ids)
            record.finish(reason)
            span.set_attribute("gen_ai.response.finish_reasons", [reason])
            span.set_attribute("gen_ai.usage.output_tokens", record.num_tokens)
            span.end()

    async def _place(
        self,
        req_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        slo: RequestSlo,
        span: Span,
    ) -> Placement:
        """Pick the worker pair (may wait in the admission queue, or shed)."""
        queue_span = self.tracing.start_span("queue", span, **{"tandem.slo_class": slo.class_name})
        try:
            placement = await self.policy.place(req_id, prompt_ids, params.max_tokens, slo)
        except Overloaded:
            self.metrics.rejected.labels(self.metrics.model_name, "overloaded").inc()
            span.set_attribute("tandem.rejected", True)
            span.end()
            raise
        finally:
            queue_span.end()
        span.set_attribute("tandem.decision", placement.decision)
        return placement

    async def _generate(
        self,
        req_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        placement: Placement,
        record: RequestRecord,
        span: Span,
    ) -> AsyncIterator[GenerationChunk]:
        pair = self.pool.pair(placement.prefill_worker_id, placement.decode_worker_id)
        usage = Usage(prompt_tokens=len(prompt_ids))
        wire_params = sampling_params_to_proto(params)
        # Without a prefill worker the decode worker must be told it may prefill itself.
        decode_request = pb.DecodeRequest(
            request_id=req_id,
            prompt_token_ids=prompt_ids,
            params=wire_params,
            local_prefill=pair.prefill_stub is None,
        )
        if pair.prefill_stub is not None:
            prefill = await self._prefill(pair, req_id, prompt_ids, wire_params, span)
            self.policy.on_prefill_done(
                req_id,
                num_cached_tokens=prefill.num_cached_tokens,
                compute_s=prefill.timings.compute_s,
            )
            usage.completion_tokens = 1
            usage.cached_prompt_tokens = prefill.num_cached_tokens
            finish = finish_reason_from_proto(prefill.finish_reason)
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
        worker, stub = pair.prefill_target()
        span = self.tracing.start_span("prefill", parent, **{"tandem.worker": worker.worker_id})
        try:
            return await stub.Prefill(
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
        local = not request.HasField("kv_handle")
        last_at: float | None = None
        try:
            async for msg in call:
                now = time.monotonic()
                if last_at is None:
                    if local:
                        self.policy.on_prefill_done(
                            request.request_id,
                            num_cached_tokens=msg.num_cached_tokens,
                            compute_s=msg.prefill_timings.compute_s
                            if msg.HasField("prefill_timings")
                            else None,
                        )
                    self.policy.on_kv_pulled(request.request_id)
                elif msg.token_ids:
                    self.policy.observe_itl(
                        request.request_id, (now - last_at) / len(msg.token_ids)
                    )
                last_at = now
                usage.completion_tokens += len(msg.token_ids)
                if local:
                    usage.cached_prompt_tokens = msg.num_cached_tokens
                finish = finish_reason_from_proto(msg.finish_reason)
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
        _, stub = pair.prefill_target()
        try:
            await asyncio.shield(
                stub.Release(
                    pb.ReleaseRequest(request_id=req_id), timeout=_RELEASE_TIMEOUT_S
                )
            )
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            logger.info("release of %s failed (%s); its lease will expire", req_id, exc)
