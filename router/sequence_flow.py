"""One sequence through the cluster, migrating when a worker fails.

An attempt is a prefill on the placement's prefill worker (or none: the decode worker
prefills locally), then the decode stream. The first token is yielded as soon as the
prefill worker returns it (TTFT never waits for the KV transfer). Cancelling the
consumer cancels the worker calls, and the workers free what they hold; a prefill whose
handle is never used, or whose decode stream failed, is released here (its lease is the
backstop if even that fails).

Migration: when a worker call fails because the worker (or the connection to it) did,
or the membership owner declares the worker lost (`worker_lost`), the sequence is
placed again without admission and continues from where the client is: the new pair
prefills prompt + every token already streamed and generates the rest. The client's
stream goes on with no duplicated or missing token (with greedy sampling, the text of
an uninterrupted run). After a migration the router detokenizes the output itself
(`continuation.py`). At most `max_migrations` per sequence; past them, one
`WorkerUnavailable`.

When no decode worker is available to move to (the only one died), a migrating sequence
whose request has streamed tokens (its own, or with n > 1 another sequence's: one 503
would end the stream the client is reading) waits up to `migration_wait_s` for one to
join or come back (the pool controller replaces a dead worker within seconds) rather
than end half streamed; one whose request has streamed nothing gets 503 at once, as a
new request does, and its client may retry. A sequence waits so once: if the worker it
moved to dies too with none left, it may be what kills them (a crash on its input), and
waiting again would crash replacement after replacement; it gets the 503 at once.

A sequence that was in a failed engine step on two workers (worker/step_failure.py) is
not moved again: it may be what breaks the engine, and moving it on would take down one
worker after another. The client gets a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable

from opentelemetry.trace import Span

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.request import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.router.attempts import (
    Attempt,
    AttemptFailed,
    AttemptRegistry,
    MigrationReason,
    worker_lost_failure,
)
from tandem.router.continuation import (
    continuation_params,
    final_chunk,
    redetokenize,
    replay_detokenizer,
)
from tandem.router.errors import RouterError, WorkerUnavailable
from tandem.router.generation_chunk import GenerationChunk
from tandem.router.metrics import RouterMetrics
from tandem.router.policy import GoodputPolicy, Placement, PlacementRequest
from tandem.router.sequence import Sequence
from tandem.router.worker_calls import WorkerCalls
from tandem.router.worker_pool import WorkerPair, WorkerPool
from tandem.worker.convert import (
    finish_reason_from_proto,
    prompt_logprobs_from_proto,
    sampling_params_to_proto,
    stop_reason_from_proto,
    top_logprobs_from_proto,
)

logger = logging.getLogger(__name__)

# Retry-After of the error a sequence gets when it ran out of migrations.
_EXHAUSTED_RETRY_AFTER_S = 1.0
# Failed engine steps a sequence may be in before it counts as their likely cause.
MAX_ENGINE_STEP_FAILURES = 2
# How often a migrating sequence with no decode worker to move to looks for one again.
MIGRATION_WAIT_POLL_S = 0.1

Chunks = AsyncGenerator[GenerationChunk, None]
# How a sequence's first attempt runs when its caller starts it (a forked request's
# sequences share one prefill); migrated attempts always run `SequenceFlow.attempt`.
FirstAttempt = Callable[[Sequence, Attempt], Chunks]


class SequenceFlow:
    """Drives sequences over the worker pool: attempts, and migrations between them."""

    def __init__(
        self,
        pool: WorkerPool,
        policy: GoodputPolicy,
        metrics: RouterMetrics,
        calls: WorkerCalls,
        attempts: AttemptRegistry,
        *,
        tokenizer: object,
        max_migrations: int,
        migration_wait_s: float,
        on_worker_failed: Callable[[str], None] | None,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.metrics = metrics
        self.calls = calls
        self.attempts = attempts
        # None: migrated sequences keep the new worker's text.
        self.tokenizer = tokenizer
        self.max_migrations = max_migrations
        self.migration_wait_s = migration_wait_s
        self.on_worker_failed = on_worker_failed

    async def run(
        self, seq: Sequence, placement: Placement, first_attempt: FirstAttempt | None = None
    ) -> Chunks:
        """The sequence's chunks until it finishes; a failure it cannot migrate past
        raises a `RouterError`. Appends what it yields to `seq.output_ids`."""
        # Set at the first migration that follows streamed tokens (see the module doc).
        detok: IncrementalDetokenizer | None = None
        placed_at = time.monotonic()
        try:
            while True:
                attempt = self.attempts.begin(placement)
                try:
                    if first_attempt is not None and seq.first_attempt:
                        chunks = first_attempt(seq, attempt)
                    else:
                        chunks = self.attempt(seq, placement, attempt, detok is not None)
                    async with contextlib.aclosing(chunks):
                        async for chunk in chunks:
                            if detok is not None:
                                chunk = redetokenize(chunk, detok)
                            if not seq.output_ids and chunk.token_ids and seq.index == 0:
                                ttft_s = time.monotonic() - placed_at
                                self.policy.observe_ttft(seq.placement_key, ttft_s)
                            seq.output_ids += chunk.token_ids
                            yield chunk
                            if chunk.finish_reason is not None:
                                return
                    return
                except AttemptFailed as failure:
                    self._count_migration(seq, failure)
                    if seq.output_ids and detok is None and self.tokenizer is not None:
                        detok = replay_detokenizer(
                            self.tokenizer, seq.prompt_ids, seq.params, seq.output_ids
                        )
                    num_left = seq.params.max_tokens - len(seq.output_ids)
                    if num_left <= 0:
                        # Every token was streamed; only the finish message was lost.
                        yield final_chunk(detok, FinishReason.LENGTH)
                        return
                    placement = await self._place_migrated(
                        seq,
                        PlacementRequest(
                            seq.migration_key, [*seq.prompt_ids, *seq.output_ids], num_left,
                            seq.slo, cache_salt=seq.params.cache_salt,
                        )
                    )  # fmt: skip
                    seq.placement_key, seq.owns_placement = seq.migration_key, True
                finally:
                    self.attempts.end(attempt)
        finally:
            if seq.owns_placement:
                self.policy.on_finish(seq.placement_key, seq.output_ids)

    async def _place_migrated(self, seq: Sequence, request: PlacementRequest) -> Placement:
        """The migrating sequence's next pair. While no decode worker is available, one
        whose request streamed tokens and that never waited before looks again every
        MIGRATION_WAIT_POLL_S for up to `migration_wait_s`; then (at once for any other)
        the policy's `WorkerUnavailable`."""
        if not seq.request_has_tokens or seq.waited_for_decode_worker:
            return self.policy.place_migrated(request)
        deadline = time.monotonic() + self.migration_wait_s
        while True:
            try:
                return self.policy.place_migrated(request)
            except WorkerUnavailable as exc:
                seq.waited_for_decode_worker = True
                if time.monotonic() >= deadline:
                    raise WorkerUnavailable(
                        f"{exc} (the request waited {self.migration_wait_s:g} s to move on "
                        f"after its worker failed)",
                        retry_after_s=exc.retry_after_s,
                    ) from exc
            await asyncio.sleep(MIGRATION_WAIT_POLL_S)

    def _count_migration(self, seq: Sequence, failure: AttemptFailed) -> None:
        """Keep new requests off the failed worker; raise the client's error if the
        sequence may not move; else count the migration and free the old placement's
        accounting (the next placement charges the new pair)."""
        if not failure.migratable:
            raise failure.error from failure.__cause__
        if self.on_worker_failed is not None and failure.reason is not MigrationReason.WORKER_LOST:
            self.on_worker_failed(failure.worker_id)
        if failure.engine_step_failed:
            seq.num_engine_step_failures += 1
            if seq.num_engine_step_failures >= MAX_ENGINE_STEP_FAILURES:
                raise RouterError(
                    f"request failed: the engine step failed on {seq.num_engine_step_failures} "
                    f"workers while running it, so it is not moved again (it may be the "
                    f"cause); last: {failure.error}"
                ) from failure.__cause__
        if seq.num_migrations >= self.max_migrations:
            raise WorkerUnavailable(
                f"request failed after {seq.num_migrations} migrations: {failure.error}",
                retry_after_s=_EXHAUSTED_RETRY_AFTER_S,
            ) from failure.__cause__
        seq.num_migrations += 1
        logger.warning(
            "request %s: worker %s failed (%s: %s); migrating after %d tokens",
            seq.req_id, failure.worker_id, failure.reason.value, failure.error,
            len(seq.output_ids),
        )  # fmt: skip
        self.metrics.migrations.labels(self.metrics.model_name, failure.reason.value).inc()
        seq.span.add_event(
            "tandem.migration",
            {"tandem.worker": failure.worker_id, "tandem.reason": failure.reason.value},
        )
        if seq.owns_placement:
            self.policy.on_finish(seq.placement_key)
            seq.owns_placement = False

    def pair_of(self, placement: Placement) -> WorkerPair:
        """The placement's workers; a worker that already left the pools is lost."""
        try:
            return self.pool.pair(placement.prefill_worker_id, placement.decode_worker_id)
        except KeyError as exc:
            raise worker_lost_failure(str(exc.args[0])) from None

    async def attempt(
        self, seq: Sequence, placement: Placement, attempt: Attempt, router_stops: bool
    ) -> Chunks:
        """One attempt of a single sequence on `placement`, after what it streamed."""
        params = seq.params
        if seq.output_ids:
            params = continuation_params(params, seq.output_ids, router_stops)
        prompt_ids = [*seq.prompt_ids, *seq.output_ids]
        pair = self.pair_of(placement)
        wire_params = sampling_params_to_proto(params)
        # Without a prefill worker the decode worker must be told it may prefill itself.
        request = pb.DecodeRequest(
            request_id=seq.req_id,
            prompt_token_ids=prompt_ids,
            params=wire_params,
            local_prefill=pair.prefill_stub is None,
        )
        if pair.prefill_stub is None:
            chunks = self.decode_local(pair, request, seq, attempt)
        else:
            prefill_request = pb.PrefillRequest(
                request_id=seq.req_id, prompt_token_ids=prompt_ids, params=wire_params
            )
            prefill = await self.calls.prefill(pair, prefill_request, seq.span, attempt)
            first = self.prefilled(seq, params, pair, prefill, len(prompt_ids))
            if first.finish_reason is not None:
                yield first
                return
            request.kv_handle.CopyFrom(prefill.kv_handle)
            request.first_token_id = prefill.first_token_id
            chunks = self.decode_held(pair, request, seq, attempt, first)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    def prefilled(
        self,
        seq: Sequence,
        params: SamplingParams,
        pair: WorkerPair,
        prefill: pb.PrefillResponse,
        num_prompt_tokens: int,
    ) -> GenerationChunk:
        """Account a finished prefill; the chunk of its first token."""
        seq.record.on_prefill(
            pair.prefill_target()[0].worker_id, "prefill",
            num_prompt_tokens - prefill.num_cached_tokens,
            prefill.timings.queue_s, prefill.timings.compute_s,
        )  # fmt: skip
        self.policy.on_prefill_done(
            seq.placement_key,
            num_cached_tokens=prefill.num_cached_tokens,
            compute_s=prefill.timings.compute_s,
        )
        if seq.reports_cached_tokens:
            seq.usage.cached_prompt_tokens = prefill.num_cached_tokens
        return GenerationChunk(
            [prefill.first_token_id],
            prefill.first_token_text,
            [prefill.first_token_logprob] if params.logprobs else [],
            finish_reason_from_proto(prefill.finish_reason),
            prompt_logprobs=prompt_logprobs_from_proto(prefill),
            stop_reason=stop_reason_from_proto(prefill),
            top_logprobs=[top_logprobs_from_proto(prefill.first_token_top_logprobs)]
            if params.top_logprobs
            else [],
        )

    async def decode_held(
        self,
        pair: WorkerPair,
        request: pb.DecodeRequest,
        seq: Sequence,
        attempt: Attempt,
        first: GenerationChunk | None,
    ) -> Chunks:
        """Decode from KV the prefill worker holds (`request.kv_handle`), after `first`
        (the prefill's token, if this sequence has it)."""
        span = self._decode_span(pair, seq)
        # The decode worker answers only once it has pulled the KV (or, when the pull
        # failed, released it and recomputed), then tells the prefill worker to unpin it;
        # after its first chunk only a decode worker that failed may not have (killed
        # right after answering: the prefill side would hold the KV for its lease).
        taken = False
        try:
            if first is not None:
                yield first
            async with contextlib.aclosing(
                self.calls.decode(pair, request, seq, span, attempt)
            ) as chunks:
                async for chunk in chunks:
                    taken = True
                    yield chunk
        except BaseException as exc:
            # Unpin (a no-op where nothing is held) before the request moves on.
            if not taken or not isinstance(exc, asyncio.CancelledError | GeneratorExit):
                await self.calls.release(pair, request.kv_handle.request_id)
                # A cancel that came during the release (the client left, the router is
                # stopping; `release` absorbs it) ends the request rather than migrate it.
                task = asyncio.current_task()
                if isinstance(exc, Exception) and task is not None and task.cancelling():
                    raise asyncio.CancelledError from exc
            raise
        finally:
            span.end()

    async def decode_local(
        self, pair: WorkerPair, request: pb.DecodeRequest, seq: Sequence, attempt: Attempt
    ) -> Chunks:
        """Decode on a worker that prefills the prompt itself."""
        span = self._decode_span(pair, seq)
        try:
            async with contextlib.aclosing(
                self.calls.decode(pair, request, seq, span, attempt)
            ) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            span.end()

    def _decode_span(self, pair: WorkerPair, seq: Sequence) -> Span:
        return self.calls.tracing.start_span(
            "decode", seq.span, **{"tandem.worker": pair.decode.worker_id,
                                   "tandem.sequence": seq.index}
        )  # fmt: skip
