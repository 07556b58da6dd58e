"""gRPC `DecodeWorker` service: admit, pull the KV, join the batch, stream tokens.

With a KvHandle the worker reserves blocks (pull-based admission: it waits until the
pool can hold the prompt), pulls the KV from the prefill worker straight into them
(a pinned write view the engine hands out while the request is receiving; no engine
step reads them until the commit, which goes through the engine queue), releases it
there and decodes from the first token. Without one it prefills locally: always in colocated
mode, and in decode mode only when the request says `local_prefill` (conditional
disaggregation; anything else is refused). A failed or timed-out pull is recomputed
locally, so the client only sees a slower stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import grpc

from tandem.engine.kv_pins import PinnedBlocks
from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.kv_transfer.blocks import CacheBlocks
from tandem.kv_transfer.client import KvTransferClient
from tandem.kv_transfer.errors import KvTransferError
from tandem.kv_transfer.handle import KvHandle
from tandem.proto.cluster_auth import internal_channel
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
from tandem.worker.engine_loop import EngineLoop, EngineLoopClosed, RequestStream
from tandem.worker.metrics import WorkerMetrics
from tandem.worker.step_failure import abort_engine_loop_closed, answers_engine_loop_closed

logger = logging.getLogger(__name__)

_ADMISSION_POLL_S = 0.01
_RELEASE_TIMEOUT_S = 5.0


async def pull_into_pinned(
    client: KvTransferClient, handle: KvHandle, pinned: PinnedBlocks
) -> None:
    """Pull straight into pinned reserved blocks (`Engine.acquire_import_kv`); the
    client unpins them once its thread stops writing. (The KV transfer benchmark
    receives through this function too.)"""
    into = CacheBlocks(pinned.kv_cache, pinned.block_ids, on_done=pinned.unpin)
    await client.pull(handle, out=into)


class NoKvBlocks(Exception):
    """The KV pool had no room for a request within the admission timeout."""


class DecodeService(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        config: WorkerConfig,
        loop: EngineLoop,
        kv_client: KvTransferClient,
        tracing: Tracing,
        metrics: WorkerMetrics,
    ) -> None:
        self.config = config
        self.tracing = tracing
        self.metrics = metrics
        self.loop = loop
        self.kv_client = kv_client
        self.num_kv_recomputes = 0
        self._peers: dict[str, grpc.aio.Channel] = {}
        self._release_tasks: set[asyncio.Task] = set()

    async def close(self) -> None:
        if self._release_tasks:
            await asyncio.wait(self._release_tasks, timeout=_RELEASE_TIMEOUT_S)
        for channel in self._peers.values():
            await channel.close()
        self._peers.clear()

    async def Decode(self, request: pb.DecodeRequest, context) -> AsyncIterator[pb.DecodeResponse]:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must not be empty")
        try:
            params = sampling_params_from_proto(request.params)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        started = time.monotonic()
        prompt = list(request.prompt_token_ids)
        recomputed = False
        transfer_s = 0.0
        parent = self.tracing.context_from(context.invocation_metadata())
        try:
            if request.HasField("kv_handle"):
                span = self.tracing.start_span("kv_transfer", parent)
                try:
                    stream, recomputed, transfer_s = await self._start_remote(
                        request, prompt, params
                    )
                finally:
                    span.set_attribute("tandem.kv_recomputed", recomputed)
                    span.end()
            else:
                # A decode worker prefills only when the router asked it to (its engine
                # refuses otherwise); a colocated worker always does.
                stream = await self.loop.generate(
                    request.request_id, prompt, params, local_prefill=request.local_prefill
                )
            span = self.tracing.start_span("decode.stream", parent)
            try:
                async with stream:
                    async for out in stream:
                        if out.cannot_start is not None:
                            await abort_cannot_start(context, request.request_id, out.cannot_start)
                        yield self._response(out, recomputed, started, transfer_s)
            finally:
                span.end()
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineLoopClosed as exc:
            await abort_engine_loop_closed(context, exc)
        except NoKvBlocks:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"no KV blocks free within {self.config.admission_timeout_s:.1f} s",
            )
        except TimeoutError as exc:
            # An engine command unanswered past its step's watchdog: the engine is stuck
            # (and its worker about to be replaced); UNAVAILABLE moves the request on.
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine did not answer: {exc}")

    def _response(
        self, out: RequestOutput, recomputed: bool, started: float, transfer_s: float
    ) -> pb.DecodeResponse:
        msg = pb.DecodeResponse(
            token_ids=out.new_token_ids,
            logprobs=out.new_logprobs,
            top_logprobs=[top_logprobs_to_proto(top) for top in out.new_top_logprobs],
            text=out.delta_text,
            finish_reason=FINISH_REASONS[out.finish_reason],
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            kv_recomputed=recomputed,
        )
        add_prompt_logprobs(msg, out.prompt_logprobs)
        set_stop_reason(msg, out.stop_reason)
        if out.prefill_s is not None:
            msg.prefill_timings.CopyFrom(pb.Timings(queue_s=out.queue_s, compute_s=out.prefill_s))
        if out.finished:
            msg.timings.CopyFrom(
                pb.Timings(compute_s=time.monotonic() - started, transfer_s=transfer_s)
            )
        return msg

    async def _start_remote(
        self, request: pb.DecodeRequest, prompt: list[int], params: SamplingParams
    ) -> tuple[RequestStream, bool, float]:
        """Reserve, pull and commit; on a failed pull, a local recompute stream."""
        req_id = request.request_id
        handle = KvHandle.from_proto(request.kv_handle)
        first = request.first_token_id
        try:
            await self._reserve(req_id, prompt, first, params)
        except BaseException:
            # Cancelled mid-call, the reservation may still land: undo it (a no-op if not).
            await asyncio.shield(self.loop.call(lambda e: e.cancel_import(req_id)))
            self._release_remote(handle)  # it will never be pulled
            raise
        started = time.monotonic()
        try:
            await self._pull_into_reserved(req_id, handle)
        except (KvTransferError, TimeoutError, OSError) as exc:
            logger.warning("KV pull for %s failed (%s); recomputing locally", req_id, exc)
            # Freed by the engine once the transfer thread (if still writing) lets go.
            await self.loop.call(lambda e: e.cancel_import(req_id))
            self.num_kv_recomputes += 1
            self.metrics.kv_recomputes.inc()
            self._release_remote(handle)
            return await self._recompute(req_id, prompt, first, params), True, 0.0
        except BaseException:
            await asyncio.shield(self.loop.call(lambda e: e.cancel_import(req_id)))
            self._release_remote(handle)
            raise
        self._release_remote(handle)
        transfer_s = time.monotonic() - started
        self.metrics.kv_transfer_seconds.observe(transfer_s)
        self.metrics.kv_transfer_bytes.inc(self.kv_client.layout.block_nbytes(handle.num_blocks))
        stream = await self.loop.submit(req_id, lambda e: e.commit_import(req_id))
        return stream, False, transfer_s

    async def _pull_into_reserved(self, req_id: str, handle: KvHandle) -> None:
        """Receive the KV straight into the request's reserved blocks. The write view is
        pinned here (a thread-safe call: no await, so no cancellation can strand the
        pin) and the pull unpins it once its thread stops writing, however it ends."""
        pinned = self.loop.engine.acquire_import_kv(req_id)
        # asyncio.timeout, not wait_for: the pull must start in this task so that it owns
        # the pin even when cancelled at once.
        async with asyncio.timeout(self.config.pull_timeout_s):
            await pull_into_pinned(self.kv_client, handle, pinned)

    async def _reserve(
        self, req_id: str, prompt: list[int], first: int, params: SamplingParams
    ) -> None:
        """Wait until the pool can hold the prompt's KV (pull-based admission)."""
        deadline = time.monotonic() + self.config.admission_timeout_s
        while True:
            block_ids = await self.loop.call(
                lambda e: e.reserve_import(req_id, prompt, first, params)
            )
            if block_ids is not None:
                return
            if time.monotonic() >= deadline:
                raise NoKvBlocks(f"no KV blocks for {req_id}")
            await asyncio.sleep(_ADMISSION_POLL_S)

    async def _recompute(
        self, req_id: str, prompt: list[int], first: int, params: SamplingParams
    ) -> RequestStream:
        """Prefill prompt + first token here; the stream continues after the first token
        (which the penalties still count as generated: `num_resumed_tokens`)."""
        rest = dataclasses.replace(
            params,
            max_tokens=params.max_tokens - 1,
            min_tokens=max(0, params.min_tokens - 1),
            num_resumed_tokens=params.num_resumed_tokens + 1,
            # The grammar (if any) resumes with the first token accepted.
            structured=params.structured and params.structured.continued([first]),
        )
        return await self.loop.generate(req_id, [*prompt, first], rest, local_prefill=True)

    def _release_remote(self, handle: KvHandle) -> None:
        """Tell the prefill worker to unpin (best effort: its lease is the backstop)."""
        task = asyncio.get_running_loop().create_task(self._release(handle))
        self._release_tasks.add(task)
        task.add_done_callback(self._release_tasks.discard)

    async def _release(self, handle: KvHandle) -> None:
        channel = self._peers.get(handle.endpoint)
        if channel is None:
            channel = internal_channel(handle.endpoint, self.config.cluster_auth, options=())
            self._peers[handle.endpoint] = channel
        stub = worker_pb2_grpc.PrefillWorkerStub(channel)
        try:
            await stub.Release(
                pb.ReleaseRequest(request_id=handle.request_id), timeout=_RELEASE_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            # One line (the error's own text is a multi-line dump); its lease frees the KV.
            logger.info("release of %s on %s failed: %s %s", handle.request_id, handle.endpoint,
                        exc.code().name, exc.details())  # fmt: skip
            if (
                exc.code() is grpc.StatusCode.UNAVAILABLE
                and self._peers.get(handle.endpoint) is channel
            ):
                # Gone (prefill workers come and go, on new ports): its channel goes too,
                # rather than one per prefill worker ever met staying open.
                del self._peers[handle.endpoint]
                await channel.close()

    @answers_engine_loop_closed
    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        aborted = await self.loop.call(lambda e: e.abort(request.request_id))
        return pb.AbortResponse(aborted=aborted)

    @answers_engine_loop_closed
    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        stats = self.loop.stats()
        transfer = self.kv_client.stats()
        return stats_to_proto(
            stats,
            self.config.worker_id,
            self.config.role,
            self.config.engine,
            num_open_streams=self.loop.num_open_streams,
            num_open_channels=transfer.num_open_channels,
            num_transfer_threads=transfer.num_transfer_threads,
            num_kv_recomputes=self.num_kv_recomputes,
        )
