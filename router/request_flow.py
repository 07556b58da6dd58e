"""One request through the cluster: prefill worker, then decode worker, as one stream.

The first token is yielded as soon as the prefill worker returns it (TTFT never waits
for the KV transfer). Cancelling the consumer cancels the worker calls, and the
workers free what they hold; a prefill whose handle is never used is released here
(its lease is the backstop if even that fails).

Migration: when a worker call fails because the worker (or the connection to it) did,
or the membership owner declares the worker lost (`worker_lost`), the request is
placed again without admission and continues from where the client is: the new pair
prefills prompt + every token already streamed and generates the rest. The client's
stream goes on with no duplicated or missing token (with greedy sampling, the text of
an uninterrupted run). After a migration the router detokenizes the output itself
(replaying what was sent), so text held back by the old worker (a partial UTF-8
character, a possible stop string) is not lost and stop strings spanning the switch are
found. At most `max_migrations` per request; past them, one `WorkerUnavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import grpc
from opentelemetry.trace import Span

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.request import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.router.chunk_stream import ChunkStream, GenerationChunk, Usage
from tandem.router.errors import (
    Overloaded,
    RouterError,
    WorkerUnavailable,
    from_worker_error,
)
from tandem.router.forked_flow import generate_forked
from tandem.router.metrics import RequestRecord, RouterMetrics
from tandem.router.policy import GoodputPolicy, Placement, RequestSlo, SloConfig
from tandem.router.worker_pool import WorkerPair, WorkerPool
from tandem.telemetry.tracing import Tracing
from tandem.worker.convert import finish_reason_from_proto, sampling_params_to_proto

logger = logging.getLogger(__name__)

_RELEASE_TIMEOUT_S = 5.0
# Migrations one request may make before the client gets an error.
DEFAULT_MAX_MIGRATIONS = 3
# Retry-After of the error a request gets when it ran out of migrations.
_EXHAUSTED_RETRY_AFTER_S = 1.0

# Status codes of a worker call that mean the worker or the connection failed (not the
# request): the request may continue elsewhere. Our own cancellation is not among them
# (it surfaces as asyncio.CancelledError); CANCELLED here is the server's doing.
_MIGRATABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
    }
)


__all__ = ["ChunkStream", "GenerationChunk", "MigrationReason", "RequestFlow", "Usage"]


class MigrationReason(enum.StrEnum):
    """The `reason` label of `tandem:request_migrations_total`."""

    # The prefill call failed (the worker died with the prompt queued or running).
    PREFILL_FAILED = "prefill_failed"
    # The decode stream broke (worker died, connection lost).
    DECODE_FAILED = "decode_failed"
    # The membership owner declared the worker dead or removed it (a drain that timed out).
    WORKER_LOST = "worker_lost"


class _AttemptFailed(Exception):
    """A worker call of one attempt failed; internal to the flow, never leaves it."""

    def __init__(
        self, worker_id: str, reason: MigrationReason, error: RouterError, migratable: bool
    ) -> None:
        super().__init__(str(error))
        self.worker_id = worker_id
        self.reason = reason
        self.error = error
        self.migratable = migratable


@dataclasses.dataclass(eq=False)
class _Attempt:
    """One placement of a request: the worker call in flight, so a lost worker can end it."""

    worker_ids: tuple[str, ...]
    # The call in flight and the worker it runs on.
    call: Any = None
    call_worker_id: str = ""
    # Workers the membership owner declared lost while this attempt used them.
    lost: set[str] = dataclasses.field(default_factory=set)

    def lose(self, worker_id: str) -> None:
        self.lost.add(worker_id)
        if self.call is not None and self.call_worker_id == worker_id:
            self.call.cancel()

    def start_call(self, worker_id: str, call: Any) -> None:
        if worker_id in self.lost:
            call.cancel()
            raise _lost(worker_id)
        self.call, self.call_worker_id = call, worker_id


def _lost(worker_id: str) -> _AttemptFailed:
    error = WorkerUnavailable(f"worker {worker_id} was lost")
    return _AttemptFailed(worker_id, MigrationReason.WORKER_LOST, error, migratable=True)


def _really_cancelled() -> bool:
    """Whether our own task is being cancelled (client gone), not just a worker call."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


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
        *,
        tokenizer: Any = None,
        max_migrations: int = DEFAULT_MAX_MIGRATIONS,
        on_worker_failed: Callable[[str], None] | None = None,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.slo = slo
        self.metrics = metrics
        self.tracing = tracing
        self.prefill_timeout_s = prefill_timeout_s
        self.request_timeout_s = request_timeout_s
        # The served model's tokenizer (router-side detokenizing after a migration);
        # None: migrated requests keep the new worker's text.
        self.tokenizer = tokenizer
        self.max_migrations = max_migrations
        # Told the id of a worker whose call failed (so nothing new is placed there).
        self.on_worker_failed = on_worker_failed
        # Attempts in flight per worker id, for `worker_lost`.
        self._attempts: dict[str, set[_Attempt]] = {}

    def worker_lost(self, worker_id: str) -> int:
        """The membership owner says the worker is dead or gone: end its calls, so their
        requests migrate. Returns how many attempts used it."""
        attempts = list(self._attempts.get(worker_id, ()))
        for attempt in attempts:
            attempt.lose(worker_id)
        return len(attempts)

    def num_attempts_on(self, worker_id: str) -> int:
        """Requests in flight on the worker (what a drain waits for)."""
        return len(self._attempts.get(worker_id, ()))

    def generate(
        self,
        req_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        slo: RequestSlo | None = None,
        n: int = 1,
    ) -> ChunkStream:
        """The request's chunks; a shed request raises `Overloaded`, worker failures
        other `RouterError`s. `slo` None = the default class. `n` > 1: n sequences from
        one prefill (forked_flow.py), each chunk tagged with its sequence's `index`.

        The request runs in a task the returned stream owns, so cancelling or closing the
        stream stops it wherever it is (worker calls cancelled, held KV released).
        """
        slo = slo or self.slo.resolve()
        if n > 1:
            return ChunkStream(generate_forked(self, req_id, prompt_ids, params, slo, n))
        return ChunkStream(self._traced(req_id, prompt_ids, params, slo))

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
        arrived_at = time.monotonic()
        placement = await self._place(req_id, prompt_ids, params, slo, span)
        record = self.metrics.record(len(prompt_ids), slo.slo.ttft_s, slo.slo.itl_s,
                                     admission_wait_s=time.monotonic() - arrived_at)  # fmt: skip
        self.metrics.disagg_decisions.labels(self.metrics.model_name, placement.decision).inc()
        reason = FinishReason.ABORT.value
        output_ids: list[int] = []
        usage = Usage(prompt_tokens=len(prompt_ids))
        # Set at the first migration that follows streamed tokens (see the module doc).
        detok: IncrementalDetokenizer | None = None
        num_migrations = 0
        placed_at = time.monotonic()
        try:
            while True:
                attempt = self._begin(placement)
                run_params = params
                if output_ids:
                    run_params = _rest(params, output_ids, router_stops=detok is not None)
                chunks = self._generate(
                    req_id,
                    [*prompt_ids, *output_ids],
                    run_params,
                    placement,
                    record,
                    span,
                    usage,
                    attempt,
                    first=num_migrations == 0,
                )
                try:
                    async with contextlib.aclosing(chunks):
                        async for chunk in chunks:
                            if detok is not None:
                                chunk = _redetokenize(chunk, detok)
                                if chunk.finish_reason is not None:
                                    chunk.usage = usage
                            if not output_ids and chunk.token_ids:
                                self.policy.observe_ttft(req_id, time.monotonic() - placed_at)
                            record.on_tokens(len(chunk.token_ids))
                            output_ids += chunk.token_ids
                            usage.completion_tokens = len(output_ids)
                            if chunk.finish_reason is not None:
                                reason = chunk.finish_reason.value  # a metrics / span label
                            yield chunk
                            if chunk.finish_reason is not None:
                                return
                    return
                except _AttemptFailed as failure:
                    if not failure.migratable:
                        raise failure.error from failure.__cause__
                    if num_migrations >= self.max_migrations:
                        raise WorkerUnavailable(
                            f"request failed after {num_migrations} migrations: {failure.error}",
                            retry_after_s=_EXHAUSTED_RETRY_AFTER_S,
                        ) from failure.__cause__
                    num_migrations += 1
                    self._note_failure(req_id, failure, span, len(output_ids))
                    if output_ids and detok is None and self.tokenizer is not None:
                        detok = _replay(self.tokenizer, prompt_ids, params, output_ids)
                    if len(output_ids) >= params.max_tokens:
                        # Every token was streamed; only the finish message was lost.
                        reason = FinishReason.LENGTH.value
                        yield _final(detok, FinishReason.LENGTH, usage)
                        return
                    placement = self.policy.place_migrated(
                        req_id,
                        [*prompt_ids, *output_ids],
                        params.max_tokens - len(output_ids),
                        slo,
                    )
                finally:
                    self._end(attempt)
        except RouterError:
            reason = "error"
            raise
        except grpc.aio.AioRpcError as exc:
            reason = "error"
            raise from_worker_error(exc) from exc
        finally:
            self.policy.on_finish(req_id, output_ids)
            record.finish(reason)
            span.set_attribute("gen_ai.response.finish_reasons", [reason])
            span.set_attribute("gen_ai.usage.output_tokens", record.num_tokens)
            span.set_attribute("tandem.migrations", num_migrations)
            span.end()

    def _begin(self, placement: Placement) -> _Attempt:
        ids = tuple(w for w in (placement.prefill_worker_id, placement.decode_worker_id) if w)
        attempt = _Attempt(ids)
        for worker_id in ids:
            self._attempts.setdefault(worker_id, set()).add(attempt)
        return attempt

    def _end(self, attempt: _Attempt) -> None:
        for worker_id in attempt.worker_ids:
            attempts = self._attempts.get(worker_id)
            if attempts is not None:
                attempts.discard(attempt)
                if not attempts:
                    del self._attempts[worker_id]

    def _note_failure(
        self, req_id: str, failure: _AttemptFailed, span: Span, num_streamed: int
    ) -> None:
        """Count the migration, keep new requests off the failed worker, free the old
        placement's accounting (the next placement charges the new pair)."""
        logger.warning(
            "request %s: worker %s failed (%s: %s); migrating after %d tokens",
            req_id, failure.worker_id, failure.reason.value, failure.error, num_streamed,
        )  # fmt: skip
        self.metrics.migrations.labels(self.metrics.model_name, failure.reason.value).inc()
        span.add_event(
            "tandem.migration",
            {"tandem.worker": failure.worker_id, "tandem.reason": failure.reason.value},
        )
        if self.on_worker_failed is not None and failure.reason is not MigrationReason.WORKER_LOST:
            self.on_worker_failed(failure.worker_id)
        self.policy.on_finish(req_id)

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
        usage: Usage,
        attempt: _Attempt,
        first: bool,
    ) -> AsyncGenerator[GenerationChunk, None]:
        """One attempt: `prompt_ids` is the prompt plus what earlier attempts streamed.
        A worker failure leaves as `_AttemptFailed`."""
        try:
            pair = self.pool.pair(placement.prefill_worker_id, placement.decode_worker_id)
        except KeyError as exc:
            # A worker of the placement left the pools before the first call.
            raise _lost(str(exc.args[0])) from None
        wire_params = sampling_params_to_proto(params)
        # Without a prefill worker the decode worker must be told it may prefill itself.
        decode_request = pb.DecodeRequest(
            request_id=req_id,
            prompt_token_ids=prompt_ids,
            params=wire_params,
            local_prefill=pair.prefill_stub is None,
        )
        if pair.prefill_stub is not None:
            prefill = await self._prefill(pair, req_id, prompt_ids, wire_params, span, attempt)
            record.on_prefill(
                pair.prefill_target()[0].worker_id, "prefill",
                len(prompt_ids) - prefill.num_cached_tokens,
                prefill.timings.queue_s, prefill.timings.compute_s,
            )  # fmt: skip
            self.policy.on_prefill_done(
                req_id,
                num_cached_tokens=prefill.num_cached_tokens,
                compute_s=prefill.timings.compute_s,
            )
            if first:
                usage.cached_prompt_tokens = prefill.num_cached_tokens
            finish = finish_reason_from_proto(prefill.finish_reason)
            first_chunk = GenerationChunk(
                [prefill.first_token_id],
                prefill.first_token_text,
                [prefill.first_token_logprob] if params.logprobs else [],
                prompt_logprobs=list(prefill.prompt_logprobs) if params.prompt_logprobs else None,
            )
            if finish is not None:
                first_chunk.finish_reason, first_chunk.usage = finish, usage
                yield first_chunk
                return
            decode_request.kv_handle.CopyFrom(prefill.kv_handle)
            decode_request.first_token_id = prefill.first_token_id
        decode_span = self.tracing.start_span(
            "decode", span, **{"tandem.worker": pair.decode.worker_id}
        )
        try:
            if pair.prefill_stub is not None:
                yield first_chunk
            async for chunk in self._decode(
                pair, decode_request, usage, params.logprobs, record, decode_span, attempt, first
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
        attempt: _Attempt,
        num_sequences: int = 1,
    ) -> pb.PrefillResponse:
        request = pb.PrefillRequest(
            request_id=req_id,
            prompt_token_ids=prompt_ids,
            params=params,
            num_sequences=num_sequences,
        )
        worker, stub = pair.prefill_target()
        span = self.tracing.start_span("prefill", parent, **{"tandem.worker": worker.worker_id})
        reason = MigrationReason.PREFILL_FAILED
        try:
            call = stub.Prefill(
                request, timeout=self.prefill_timeout_s, metadata=self.tracing.metadata(span)
            )
            attempt.start_call(worker.worker_id, call)
            return await call
        except grpc.aio.AioRpcError as exc:
            raise _failed(worker.worker_id, reason, exc) from exc
        except asyncio.CancelledError:
            if worker.worker_id in attempt.lost and not _really_cancelled():
                raise _lost(worker.worker_id) from None
            raise
        finally:
            attempt.call = None
            span.end()

    async def _decode(
        self,
        pair: WorkerPair,
        request: pb.DecodeRequest,
        usage: Usage,
        logprobs: bool,
        record: RequestRecord,
        span: Span,
        attempt: _Attempt,
        first: bool,
    ) -> AsyncGenerator[GenerationChunk, None]:
        worker_id = pair.decode.worker_id
        reason = MigrationReason.DECODE_FAILED
        call = pair.decode_stub.Decode(
            request, timeout=self.request_timeout_s, metadata=self.tracing.metadata(span)
        )
        local = not request.HasField("kv_handle")
        last_at: float | None = None
        try:
            attempt.start_call(worker_id, call)
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
                if local and msg.HasField("prefill_timings"):
                    timings = msg.prefill_timings
                    num_computed = len(request.prompt_token_ids) - msg.num_cached_tokens
                    record.on_prefill(worker_id, "decode", num_computed, timings.queue_s,
                                      timings.compute_s)  # fmt: skip
                record.on_decoded(worker_id, len(msg.token_ids))
                if local and first:
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
                    prompt_logprobs=list(msg.prompt_logprobs) or None,
                )
                if finish is not None:
                    return
        except grpc.aio.AioRpcError as exc:
            raise _failed(worker_id, reason, exc) from exc
        except asyncio.CancelledError:
            if worker_id in attempt.lost and not _really_cancelled():
                raise _lost(worker_id) from None
            raise
        finally:
            attempt.call = None
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
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.CancelledError) as exc:
            # (UsageError: the worker left the pool and its channel is closed.)
            logger.info("release of %s failed (%s); its lease will expire", req_id, exc)


def _failed(worker_id: str, reason: MigrationReason, exc: grpc.aio.AioRpcError) -> _AttemptFailed:
    return _AttemptFailed(
        worker_id, reason, from_worker_error(exc), migratable=exc.code() in _MIGRATABLE_CODES
    )


def _rest(params: SamplingParams, streamed: list[int], router_stops: bool) -> SamplingParams:
    """The sampling params of a continuation after the `streamed` tokens.

    With `router_stops`, stop strings are left to the router's detokenizer, which sees
    the whole output (the new worker would see only the part it generates). The streamed
    tokens end the new prompt; `num_resumed_tokens` tells the workers' penalties that
    they were generated. A grammar
    resumes with the streamed tokens accepted.
    """
    num_streamed = len(streamed)
    structured = params.structured
    return dataclasses.replace(
        params,
        max_tokens=params.max_tokens - num_streamed,
        min_tokens=max(0, params.min_tokens - num_streamed),
        stop=[] if router_stops else list(params.stop),
        num_resumed_tokens=params.num_resumed_tokens + num_streamed,
        prompt_logprobs=False,  # the client has them from the first attempt
        structured=None if structured is None else structured.continued(streamed),
    )


def _replay(
    tokenizer: Any, prompt_ids: list[int], params: SamplingParams, output_ids: list[int]
) -> IncrementalDetokenizer:
    """A detokenizer in the state the first worker's was after `output_ids` (the same
    algorithm on the same tokens releases the same text, so what it holds is what the
    client has not seen yet)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    for token_id in output_ids:
        detok.add_token(token_id)
    return detok


def _redetokenize(chunk: GenerationChunk, detok: IncrementalDetokenizer) -> GenerationChunk:
    """The chunk with the router's text; cut (and finished) at a completed stop string."""
    text = ""
    for i, token_id in enumerate(chunk.token_ids):
        update = detok.add_token(token_id)
        text += update.delta_text
        if update.stop_string is not None:
            return dataclasses.replace(
                chunk,
                token_ids=chunk.token_ids[: i + 1],
                text=text,
                logprobs=chunk.logprobs[: i + 1],
                finish_reason=FinishReason.STOP,
                usage=chunk.usage,
            )
    if chunk.finish_reason is not None:
        text += detok.flush()
        if detok.stop_string is not None:
            return dataclasses.replace(chunk, text=text, finish_reason=FinishReason.STOP)
    return dataclasses.replace(chunk, text=text)


def _final(
    detok: IncrementalDetokenizer | None, reason: FinishReason, usage: Usage
) -> GenerationChunk:
    """A token-less last chunk (the finish message was lost with the worker)."""
    return GenerationChunk([], detok.flush() if detok is not None else "", [], reason, usage)
