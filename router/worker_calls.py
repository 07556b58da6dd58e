"""The gRPC calls of one attempt: `Prefill`, the `Decode` stream, `Release`.

Each call feeds the policy's progress hooks and the request's metrics record as its
answers arrive. A failed call leaves as `AttemptFailed` (migratable or not); a call
cancelled because its worker was declared lost leaves the same way. Our own
cancellation (the client left) goes on as `asyncio.CancelledError`, and the worker
aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator

import grpc
from opentelemetry.trace import Span

from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.router.attempts import Attempt, MigrationReason, call_failure
from tandem.router.generation_chunk import GenerationChunk
from tandem.router.policy import GoodputPolicy
from tandem.router.sequence import Sequence
from tandem.router.worker_pool import WorkerPair
from tandem.telemetry.tracing import Tracing
from tandem.worker.convert import (
    finish_reason_from_proto,
    prompt_logprobs_from_proto,
    stop_reason_from_proto,
    top_logprobs_from_proto,
)

logger = logging.getLogger(__name__)

_RELEASE_TIMEOUT_S = 5.0
# Inter-token gaps teach the decode model as means over spans of this many tokens: a busy
# event loop reads a stream's messages in bursts, and the ~0 s between two messages of
# one burst would teach it a free decode step (one such gap in five took its predicted
# step from 25 ms to 0.1 ms).
ITL_SPAN_TOKENS = 8
# A stream's last span teaches too once it holds this many tokens, so that outputs
# shorter than a span (at most 8 tokens) teach the model as well.
ITL_LAST_SPAN_MIN_TOKENS = 4


class TokenSpan:
    """Tokens one decode stream delivered since `start_s`."""

    def __init__(self, start_s: float) -> None:
        self.start_s = start_s
        self.num_tokens = 0

    def add(self, num_tokens: int, now_s: float, last: bool = False) -> float | None:
        """Count `num_tokens` arriving at `now_s`; once the span holds `ITL_SPAN_TOKENS`
        (or, in the stream's `last` message, `ITL_LAST_SPAN_MIN_TOKENS`), its mean
        inter-token gap (and a new span starts)."""
        self.num_tokens += num_tokens
        if self.num_tokens < (ITL_LAST_SPAN_MIN_TOKENS if last else ITL_SPAN_TOKENS):
            return None
        gap_s = (now_s - self.start_s) / self.num_tokens
        self.start_s, self.num_tokens = now_s, 0
        return gap_s


class WorkerCalls:
    """Makes one attempt's worker calls, with the router's timeouts and tracing."""

    def __init__(
        self,
        policy: GoodputPolicy,
        tracing: Tracing,
        prefill_timeout_s: float,
        request_timeout_s: float,
    ) -> None:
        self.policy = policy
        self.tracing = tracing
        self.prefill_timeout_s = prefill_timeout_s
        self.request_timeout_s = request_timeout_s

    async def prefill(
        self,
        pair: WorkerPair,
        request: pb.PrefillRequest,
        parent: Span,
        attempt: Attempt,
    ) -> pb.PrefillResponse:
        worker, stub = pair.prefill_target()
        span = self.tracing.start_span("prefill", parent, **{"tandem.worker": worker.worker_id})
        try:
            call = stub.Prefill(
                request, timeout=self.prefill_timeout_s, metadata=self.tracing.metadata(span)
            )
            attempt.start_call(worker.worker_id, call)
            return await call
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                # The worker may have answered as the deadline passed, its KV pinned for
                # a pull that will never come: unpin it, a no-op if nothing is held.
                await self.release(pair, request.request_id)
            raise call_failure(worker.worker_id, MigrationReason.PREFILL_FAILED, exc) from exc
        except asyncio.CancelledError:
            if (failure := attempt.failure_on_cancel(worker.worker_id)) is not None:
                raise failure from None
            # The client left. The worker may have answered already and hold the prompt's
            # KV for a pull that will never come (it releases it only if it sees the
            # cancel before answering): unpin it, a no-op if nothing is held.
            await self.release(pair, request.request_id)
            raise
        finally:
            attempt.end_call()
            span.end()

    async def decode(
        self,
        pair: WorkerPair,
        request: pb.DecodeRequest,
        seq: Sequence,
        span: Span,
        attempt: Attempt,
    ) -> AsyncGenerator[GenerationChunk, None]:
        """The decode stream's chunks (no `usage`: the request flow sets it)."""
        worker_id = pair.decode.worker_id
        call = pair.decode_stub.Decode(
            request, timeout=self.request_timeout_s, metadata=self.tracing.metadata(span)
        )
        key, record = seq.placement_key, seq.record
        local = not request.HasField("kv_handle")
        gaps: TokenSpan | None = None
        try:
            attempt.start_call(worker_id, call)
            async for msg in call:
                now = time.monotonic()
                finish = finish_reason_from_proto(msg.finish_reason)
                if gaps is None:
                    gaps = TokenSpan(now)
                    if local:
                        self.policy.on_prefill_done(
                            key,
                            num_cached_tokens=msg.num_cached_tokens,
                            compute_s=msg.prefill_timings.compute_s
                            if msg.HasField("prefill_timings")
                            else None,
                        )
                    self.policy.on_kv_pulled(key)
                elif (gap_s := gaps.add(len(msg.token_ids), now, finish is not None)) is not None:
                    self.policy.observe_itl(key, gap_s)
                if local and msg.HasField("prefill_timings"):
                    timings = msg.prefill_timings
                    num_computed = len(request.prompt_token_ids) - msg.num_cached_tokens
                    record.on_prefill(worker_id, "decode", num_computed, timings.queue_s,
                                      timings.compute_s)  # fmt: skip
                record.on_decoded(worker_id, len(msg.token_ids))
                if local and seq.reports_cached_tokens:
                    seq.usage.cached_prompt_tokens = msg.num_cached_tokens
                if msg.timings.transfer_s > 0:
                    record.on_kv_transfer(msg.timings.transfer_s)
                yield GenerationChunk(
                    list(msg.token_ids),
                    msg.text,
                    list(msg.logprobs) if seq.params.logprobs else [],
                    finish,
                    prompt_logprobs=prompt_logprobs_from_proto(msg),
                    stop_reason=stop_reason_from_proto(msg),
                    top_logprobs=[top_logprobs_from_proto(top) for top in msg.top_logprobs],
                )
                if finish is not None:
                    return
        except grpc.aio.AioRpcError as exc:
            raise call_failure(worker_id, MigrationReason.DECODE_FAILED, exc) from exc
        except asyncio.CancelledError:
            if (failure := attempt.failure_on_cancel(worker_id)) is not None:
                raise failure from None
            raise
        finally:
            attempt.end_call()
            # Client gone or finished early: the decode worker aborts on cancellation.
            call.cancel()

    async def release(self, pair: WorkerPair, held_id: str) -> None:
        """Unpin a prefill nobody will pull (a no-op on the worker if it was pulled)."""
        _, stub = pair.prefill_target()
        try:
            await asyncio.shield(
                stub.Release(pb.ReleaseRequest(request_id=held_id), timeout=_RELEASE_TIMEOUT_S)
            )
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            # (UsageError: the worker left the pool and its channel is closed.)
            logger.info("release of %s failed (%s); its lease will expire", held_id, exc)
        except asyncio.CancelledError:
            # Cancelled again while releasing (the callers re-raise their own cancel): the
            # shielded call goes on, and the lease is the backstop if it fails.
            logger.debug("release of %s continues without its caller", held_id)
