"""A request through the cluster: admission and placement, then its sequences, as one
stream of chunks.

`RequestFlow` is what the APIs call. It places the request (the admission queue may
hold or shed it), then drives its sequences: one (`sequence_flow.py`: prefill worker,
then decode worker, migrating when a worker fails) or, for `n > 1`, n from one prefill
(`forked_flow.py`). It keeps the request's usage, metrics record and trace span, and
answers the membership owner's `worker_lost` by ending the calls on that worker, so
their sequences migrate.

Data flows one way: request_flow → forked_flow → sequence_flow → worker_calls, with
attempts.py (the failures), continuation.py (what a migrated sequence resumes with) and
sequence.py (a sequence's state) below them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import grpc
from opentelemetry.trace import Span

from tandem.engine.request import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tandem.router.attempts import AttemptRegistry, MigrationReason
from tandem.router.chunk_stream import ChunkStream
from tandem.router.errors import Overloaded, RouterError, WorkerUnavailable, from_worker_error
from tandem.router.forked_flow import generate_forked
from tandem.router.generation_chunk import GenerationChunk, Usage
from tandem.router.metrics import RouterMetrics
from tandem.router.policy import GoodputPolicy, Placement, PlacementRequest, RequestSlo, SloConfig
from tandem.router.sequence import Sequence, sequence_id, sequence_params
from tandem.router.sequence_flow import SequenceFlow
from tandem.router.worker_calls import WorkerCalls
from tandem.router.worker_pool import WorkerPool
from tandem.telemetry.tracing import Tracing

# Migrations one sequence may make before the client gets an error.
DEFAULT_MAX_MIGRATIONS = 3

__all__ = ["ChunkStream", "GenerationChunk", "MigrationReason", "RequestFlow", "Usage"]


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
        migration_wait_s: float,
        on_worker_failed: Callable[[str], None] | None = None,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.slo = slo
        self.metrics = metrics
        self.tracing = tracing
        # Attempts in flight per worker id, for `worker_lost`.
        self._attempts = AttemptRegistry()
        self.sequences = SequenceFlow(
            pool,
            policy,
            metrics,
            WorkerCalls(policy, tracing, prefill_timeout_s, request_timeout_s),
            self._attempts,
            # The served model's tokenizer (router-side detokenizing after a migration).
            tokenizer=tokenizer,
            max_migrations=max_migrations,
            # How long a migrating sequence waits for a decode worker when none is left.
            migration_wait_s=migration_wait_s,
            # Told the id of a worker whose call failed (so nothing new is placed there).
            on_worker_failed=on_worker_failed,
        )

    def worker_lost(self, worker_id: str) -> int:
        """The membership owner says the worker is dead or gone: end its calls, so their
        sequences migrate. Returns how many calls were in flight on it."""
        return self._attempts.lose_worker(worker_id)

    def num_attempts_on(self, worker_id: str) -> int:
        """Attempts in flight on the worker (what a drain waits for)."""
        return self._attempts.num_on(worker_id)

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
        return ChunkStream(self._run(req_id, prompt_ids, params, slo, n))

    async def _run(
        self, req_id: str, prompt_ids: list[int], params: SamplingParams, slo: RequestSlo, n: int
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
        # A forked request's decode worker holds the prompt once (its full blocks shared
        # by the n sequences; each re-holds at most the last partial one) and n outputs.
        charged = dataclasses.replace(params, max_tokens=n * params.max_tokens) if n > 1 else params
        placement = await self._place(req_id, prompt_ids, charged, slo, span)
        record = self.metrics.record(len(prompt_ids), slo.slo.ttft_s, slo.slo.itl_s,
                                     arrived_at=arrived_at)  # fmt: skip
        self.metrics.disagg_decisions.labels(self.metrics.model_name, placement.decision).inc()
        usage = Usage(prompt_tokens=len(prompt_ids))
        sequences = [
            Sequence(
                req_id=sequence_id(req_id, i),
                index=i,
                prompt_ids=prompt_ids,
                params=sequence_params(params, i),
                slo=slo,
                usage=usage,
                record=record,
                span=span,
                placement_key=req_id,
                # One sequence owns the request's placement; n share it.
                owns_placement=n == 1,
                migration_key=req_id if n == 1 else f"{req_id}#{i}",
            )
            for i in range(n)
        ]
        if n == 1:
            chunks = self.sequences.run(sequences[0], placement)
        else:
            chunks = generate_forked(self.sequences, sequences, placement)
        reason = FinishReason.ABORT.value  # a metrics / span label: the client may leave
        num_finished = 0
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    record.on_tokens(len(chunk.token_ids))
                    usage.completion_tokens += len(chunk.token_ids)
                    if chunk.finish_reason is not None:
                        chunk.usage = usage
                        num_finished += 1
                        if num_finished == n:
                            reason = chunk.finish_reason.value
                    yield chunk
        except RouterError:
            reason = "error"
            raise
        except grpc.aio.AioRpcError as exc:
            reason = "error"
            raise from_worker_error(exc) from exc
        finally:
            self.policy.on_finish(req_id)  # the shared placement of n > 1 (else a no-op)
            record.finish(reason)
            span.set_attribute("gen_ai.response.finish_reasons", [reason])
            span.set_attribute("gen_ai.usage.output_tokens", record.num_tokens)
            span.set_attribute("tandem.migrations", sum(s.num_migrations for s in sequences))
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
        waiting = self.metrics.waiting.labels(self.metrics.model_name)
        waiting.inc()
        try:
            placement = await self.policy.place(
                PlacementRequest(
                    req_id, prompt_ids, params.max_tokens, slo, cache_salt=params.cache_salt
                )
            )
        except (Overloaded, WorkerUnavailable) as exc:
            # Shed by admission, or no worker pair to place it on (a whole role down).
            reason = "overloaded" if isinstance(exc, Overloaded) else "unavailable"
            self.metrics.rejected.labels(self.metrics.model_name, reason).inc()
            span.set_attribute("tandem.rejected", True)
            span.end()
            raise
        finally:
            waiting.dec()
            queue_span.end()
        span.set_attribute("tandem.decision", placement.decision)
        return placement
