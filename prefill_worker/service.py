"""gRPC `PrefillWorker` service: prefill a prompt, answer its first token and KvHandle.

The engine runs in prefill-only mode: a request ends after its first token with its
prompt blocks pinned under a lease. The handle tells the decode worker where to pull
them; `Release` (or lease expiry) unpins them, leaving them in the prefix cache.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import grpc

from tandem.engine.llm_engine import Engine
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import FinishReason
from tandem.kv_transfer.handle import KvHandle
from tandem.kv_transfer.layout import KvLayout
from tandem.kv_transfer.stats import TransferStats
from tandem.proto.tandem.worker.v1 import worker_pb2 as pb
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc
from tandem.telemetry.tracing import Tracing
from tandem.worker.cannot_start import abort_cannot_start
from tandem.worker.config import WorkerConfig
from tandem.worker.convert import (
    FINISH_REASONS,
    add_prompt_logprobs,
    sampling_params_from_proto,
    set_stop_reason,
    stats_to_proto,
    top_logprobs_to_proto,
)
from tandem.worker.engine_loop import EngineLoop, EngineLoopClosed
from tandem.worker.step_failure import abort_engine_loop_closed, answers_engine_loop_closed

logger = logging.getLogger(__name__)


class PrefillService(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(
        self,
        config: WorkerConfig,
        loop: EngineLoop,
        layout: KvLayout,
        endpoint: str,
        transfer_stats: Callable[[], TransferStats],
        tracing: Tracing,
    ) -> None:
        self.config = config
        self.loop = loop
        self.fingerprint = layout.fingerprint()
        self.endpoint = endpoint
        self._transfer_stats = transfer_stats
        self.tracing = tracing

    async def Prefill(
        self,
        request: pb.PrefillRequest,
        context: grpc.aio.ServicerContext[pb.PrefillRequest, pb.PrefillResponse],
    ) -> pb.PrefillResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
        try:
            params = sampling_params_from_proto(request.params)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        req_id = request.request_id
        last: RequestOutput | None = None
        parent = self.tracing.context_from(context.invocation_metadata())
        span = self.tracing.start_span("prefill.compute", parent, **{"tandem.request_id": req_id})
        try:
            prompt = list(request.prompt_token_ids)
            async with await self.loop.generate(req_id, prompt, params) as stream:
                async for out in stream:
                    last = out
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineLoopClosed as exc:
            await abort_engine_loop_closed(context, exc)
        finally:
            if last is not None:
                span.set_attribute("tandem.cached_tokens", last.num_cached_tokens)
            span.end()
        if last is None or not last.finished:
            await context.abort(grpc.StatusCode.INTERNAL, f"prefill of {req_id} did not finish")
        if not last.new_token_ids:
            if last.cannot_start is not None:
                await abort_cannot_start(context, req_id, last.cannot_start)
            # Ended before its first token otherwise (aborted meanwhile).
            await context.abort(grpc.StatusCode.INTERNAL, f"prefill of {req_id} was aborted")
        response = pb.PrefillResponse(
            first_token_id=last.new_token_ids[0],
            first_token_logprob=last.new_logprobs[0],
            first_token_text=last.delta_text,
            num_cached_tokens=last.num_cached_tokens,
            timings=pb.Timings(
                queue_s=last.queue_s or 0.0,
                compute_s=last.prefill_s if last.prefill_s is not None else 0.0,
            ),
        )
        add_prompt_logprobs(response, last.prompt_logprobs)
        if last.new_top_logprobs:
            top = top_logprobs_to_proto(last.new_top_logprobs[0])
            response.first_token_top_logprobs.CopyFrom(top)
        if last.finish_reason is not FinishReason.PREFILLED:
            response.finish_reason = FINISH_REASONS[last.finish_reason]
            set_stop_reason(response, last.stop_reason)
            return response
        try:
            handle = await self._handle(req_id, last.num_prompt_tokens)
        except BaseException:
            # The caller never gets the handle (cancelled, or the lease already ran out).
            await self._release(req_id)
            raise
        response.kv_handle.CopyFrom(handle.to_proto())
        if context.cancelled():
            await self._release(req_id)
        return response

    async def _handle(self, held_id: str, num_tokens: int) -> KvHandle:
        block_ids = await self.loop.call(lambda e: e.held_block_ids(held_id))
        return KvHandle(
            worker_id=self.config.worker_id,
            endpoint=self.endpoint,
            request_id=held_id,
            block_ids=block_ids,
            num_tokens=num_tokens,
            layout_fingerprint=self.fingerprint,
            lease_expiry_unix_s=time.time() + self.config.engine.kv_lease_s,
        )

    async def _release(self, req_id: str) -> None:
        await self.loop.call(functools.partial(Engine.release, req_id=req_id))

    @answers_engine_loop_closed
    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        released = await self.loop.call(lambda e: e.release(request.request_id))
        return pb.ReleaseResponse(released=released)

    @answers_engine_loop_closed
    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        stats = self.loop.stats()
        transfer = self._transfer_stats()
        return stats_to_proto(
            stats,
            self.config.worker_id,
            self.config.role,
            self.config.engine,
            num_open_streams=self.loop.num_open_streams,
            num_open_channels=transfer.num_open_channels,
            num_transfer_threads=transfer.num_transfer_threads,
        )
