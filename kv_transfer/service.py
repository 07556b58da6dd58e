"""Prefill side of KV transfer: the `KvTransfer` gRPC service (control plane).

`OpenChannel` checks the layout fingerprint (FAILED_PRECONDITION on mismatch, with
every differing field) and sets up the data plane of the chosen backend: for TCP the
host:port of the service's data server (one socket per channel), for NCCL a 2-rank
communicator, for CUDA IPC the cache's IPC description; AUTO (and every explicit
GPU choice) is settled by `cuda_ipc.choose_channel_backend` from both workers'
placements. `Pull` is NCCL's send trigger and CUDA IPC's pin (TCP pulls on its
socket); `FinishPull` ends a CUDA IPC pull. `CloseChannel` frees a channel, and so
does the service for an NCCL or CUDA IPC channel no call has used for `idle_close_s`
(its decode worker is gone, `kv_transfer.idle_channels`); `stop()` frees everything.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import uuid
from collections.abc import Callable

import grpc
import torch

from tandem.kv_transfer.blocks import CacheBlocks, ReadBlocks, check_shape, finished_with
from tandem.kv_transfer.cuda_ipc import (
    BackendRefused,
    CudaIpcCache,
    Placement,
    choose_channel_backend,
)
from tandem.kv_transfer.cuda_ipc_channel import CudaIpcServerChannel
from tandem.kv_transfer.errors import LayoutMismatchError
from tandem.kv_transfer.idle_channels import PREFILL_IDLE_CLOSE_S, IdleChannels
from tandem.kv_transfer.layout import KvLayout
from tandem.kv_transfer.nccl import NCCL_UNIQUE_ID_BYTES, NcclError, load_nccl
from tandem.kv_transfer.nccl_channel import PREFILL_RANK, NcclServerChannel
from tandem.kv_transfer.stats import TransferStats, count_threads, wait_threads_gone
from tandem.kv_transfer.tcp_server import TcpDataServer
from tandem.proto.cluster_auth import ClusterAuth
from tandem.proto.tandem.worker.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


# The backends a decode worker may ask for beyond tcp; AUTO is settled here.
_GPU_BACKENDS = {
    worker_pb2.KV_BACKEND_NCCL: "nccl",
    worker_pb2.KV_BACKEND_CUDA_IPC: "cuda_ipc",
    worker_pb2.KV_BACKEND_AUTO: "auto",
}


class KvTransferService(worker_pb2_grpc.KvTransferServicer):
    """Serves one prefill worker's held KV to decode workers."""

    def __init__(
        self,
        layout: KvLayout,
        read_blocks: ReadBlocks,
        host: str = "127.0.0.1",
        *,
        timeout_s: float = 30.0,
        advertise_host: str | None = None,
        device: str | None = None,
        auth: ClusterAuth | None = None,
        on_refused: Callable[[], None] | None = None,
        kv_cache: torch.Tensor | None = None,
        idle_close_s: float = PREFILL_IDLE_CLOSE_S,
    ) -> None:
        """`read_blocks(request_id)`: see `kv_transfer.blocks` (called from transfer
        threads, so it must be thread-safe; KeyError when nothing is held).
        `advertise_host`: the data server's address as decode workers reach it (default
        `host`). `device`: CUDA device of NCCL channels (default the current one).
        `auth`: the cluster token every TCP data connection must prove (the gRPC calls
        are checked by the server's interceptor, see `tandem.proto.cluster_auth`);
        `on_refused` is called (from a transfer thread) for each connection refused.
        `kv_cache`: the paged cache `read_blocks` serves from; a CUDA one is shared with
        decode workers on this node (cuda_ipc) and places this worker on its GPU.
        `idle_close_s`: an NCCL or cuda_ipc channel no call has used this long is closed."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.layout = layout
        self.read_blocks = read_blocks
        self.timeout_s = timeout_s
        self._device = device
        self._tcp = TcpDataServer(
            layout, read_blocks, host, timeout_s, advertise_host, auth, on_refused
        )
        self._nccl: dict[str, NcclServerChannel] = {}
        self._ipc: dict[str, CudaIpcServerChannel] = {}
        # When each NCCL and cuda_ipc channel was last used (TCP ones end with their socket).
        self._idle = IdleChannels[str](idle_close_s)
        self._kv_cache = kv_cache
        self._ipc_export: bytes | None = None  # the cache's IPC description, made once
        gpu = kv_cache.device if kv_cache is not None and kv_cache.is_cuda else device
        self.placement = Placement.here(gpu)
        self._thread_prefix = f"kv-service-{id(self):x}"
        # NCCL init and GPU gathers only; created on the first NCCL channel.
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        # Unpins cuda_ipc pulls whose FinishPull never came (a decode worker that died
        # between its Pull and FinishPull pulls on that channel no more, so the expiry at
        # the next Pull never ran) and closes idle NCCL and cuda_ipc channels; started
        # with the first of those.
        self._sweeper: asyncio.Task | None = None
        self._stopped = False

    def start(self) -> str:
        """Start the TCP data server now (else on the first TCP channel); its host:port."""
        return self._tcp.start()

    async def stop(self) -> None:
        """Close every channel, the data server, its sockets and threads."""
        self._stopped = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        for channel in self._nccl.values():
            channel.close(abort=True)
        self._nccl.clear()
        for ipc in self._ipc.values():
            ipc.close()
        self._ipc.clear()
        await self._tcp.stop()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            if await wait_threads_gone(self._thread_prefix, self.timeout_s):
                logger.warning("NCCL init threads still running after stop")

    @property
    def num_refused_connections(self) -> int:
        """TCP data connections refused for a missing or wrong cluster token proof."""
        return self._tcp.refusals.num_refused

    def stats(self) -> TransferStats:
        return TransferStats(
            num_open_channels=self._tcp.num_channels + len(self._nccl) + len(self._ipc),
            num_transfer_threads=self._tcp.num_threads + count_threads(self._thread_prefix),
        )

    # ----- RPCs -------------------------------------------------------------------

    async def OpenChannel(
        self, request: worker_pb2.OpenChannelRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.OpenChannelResponse:
        if self._stopped:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "KV transfer service stopped")
        try:
            self.layout.check_matches(
                request.layout_fingerprint, self_role="prefill", other_role="decode"
            )
        except LayoutMismatchError as e:
            logger.error("decode worker %s: %s", request.decode_worker_id, e)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        channel_id = uuid.uuid4().hex
        backend = request.backend
        if backend in (worker_pb2.KV_BACKEND_TCP, worker_pb2.KV_BACKEND_UNSPECIFIED):
            endpoint = self._tcp.open_channel(channel_id)
            logger.info("KV channel %s (tcp) for %s", channel_id, request.decode_worker_id)
            return worker_pb2.OpenChannelResponse(channel_id=channel_id, tcp_endpoint=endpoint)
        requested = _GPU_BACKENDS.get(backend)
        if requested is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"backend {backend} is not served over gRPC"
            )
        decode = Placement(request.node_id, request.pid, request.gpu_uuid)
        try:
            chosen = choose_channel_backend(
                requested, decode, self.placement, bool(request.nccl_unique_id)
            )
        except BackendRefused as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        logger.info("KV channel %s (%s) for %s", channel_id, chosen, request.decode_worker_id)
        if chosen == "nccl":
            await self._open_nccl(channel_id, request, context)
            return worker_pb2.OpenChannelResponse(
                channel_id=channel_id, nccl_rank=PREFILL_RANK, backend=worker_pb2.KV_BACKEND_NCCL
            )
        if chosen == "cuda_ipc":
            description = await self._cuda_ipc_export(context)
            self._ipc[channel_id] = CudaIpcServerChannel(channel_id, self.timeout_s)
            self._opened(channel_id)
            return worker_pb2.OpenChannelResponse(
                channel_id=channel_id,
                backend=worker_pb2.KV_BACKEND_CUDA_IPC,
                cuda_ipc_cache=description,
            )
        endpoint = self._tcp.open_channel(channel_id)
        return worker_pb2.OpenChannelResponse(
            channel_id=channel_id, tcp_endpoint=endpoint, backend=worker_pb2.KV_BACKEND_TCP
        )

    def _opened(self, channel_id: str) -> None:
        """An NCCL or cuda_ipc channel was opened: its idle clock and the sweeper start."""
        self._idle.touch(channel_id)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        """Every half timeout: unpin each cuda_ipc channel's pulls past their deadline,
        then close the idle channels."""
        while True:
            await asyncio.sleep(self.timeout_s / 2)
            for channel in list(self._ipc.values()):
                channel.expire()
            self.close_idle_channels()

    def close_idle_channels(self) -> int:
        """Close the NCCL and cuda_ipc channels no call has used for `idle_close_s` (one
        with a pull pinned or sending waits for the next sweep); how many."""
        closed = 0
        for channel_id in self._idle.idle():
            ipc, nccl = self._ipc.get(channel_id), self._nccl.get(channel_id)
            if (ipc is not None and ipc.num_pinned) or (nccl is not None and nccl.lock.locked()):
                continue
            self._idle.forget(channel_id)
            if ipc is None and nccl is None:  # closed meanwhile (a failed send)
                continue
            if ipc is not None:
                del self._ipc[channel_id]
                ipc.close()
            if nccl is not None:
                del self._nccl[channel_id]
                nccl.close(abort=True)
            closed += 1
            logger.info("KV channel %s: unused for %g s, closed (its decode worker is gone)",
                        channel_id, self._idle.idle_close_s)  # fmt: skip
        return closed

    async def _cuda_ipc_export(self, context: grpc.aio.ServicerContext) -> bytes:
        if self._ipc_export is None:
            if self._kv_cache is None or not self._kv_cache.is_cuda:
                await context.abort(
                    grpc.StatusCode.UNIMPLEMENTED, "this prefill worker has no CUDA cache to share"
                )
            assert self._kv_cache is not None
            self._ipc_export = CudaIpcCache.export(self._kv_cache).to_bytes()
        return self._ipc_export

    async def _open_nccl(
        self,
        channel_id: str,
        request: worker_pb2.OpenChannelRequest,
        context: grpc.aio.ServicerContext,
    ) -> None:
        if len(request.nccl_unique_id) != NCCL_UNIQUE_ID_BYTES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"nccl_unique_id must be {NCCL_UNIQUE_ID_BYTES} bytes",
            )
        try:
            load_nccl()
        except NcclError as e:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"NCCL unavailable: {e}")
        device = torch.device(self._device or f"cuda:{torch.cuda.current_device()}")
        channel = NcclServerChannel(channel_id, device, self.timeout_s)
        channel.start_init(request.nccl_unique_id, self._nccl_executor())
        self._nccl[channel_id] = channel
        self._opened(channel_id)
        logger.info("KV channel %s (nccl) for %s", channel_id, request.decode_worker_id)

    async def Pull(
        self, request: worker_pb2.PullRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PullResponse:
        if request.channel_id in self._ipc:
            self._idle.touch(request.channel_id)
            return await self._pull_ipc(request, context)
        channel = self._nccl.get(request.channel_id)
        if channel is None:
            # Not NOT_FOUND, which says the request's KV is not held: the channel is what
            # is missing (closed, or idle too long), and the decode side opens a new one.
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no open NCCL or cuda_ipc channel {request.channel_id!r}",
            )
        self._idle.touch(request.channel_id)
        loop = asyncio.get_running_loop()
        async with channel.lock:
            try:
                blocks = await loop.run_in_executor(
                    self._nccl_executor(), self._read_gathered, request.request_id
                )
            except KeyError:
                await context.abort(
                    grpc.StatusCode.NOT_FOUND, f"no KV held for request {request.request_id!r}"
                )
            except ValueError as e:
                await context.abort(grpc.StatusCode.INTERNAL, str(e))
            try:
                num_bytes = await channel.send(blocks)
            except (NcclError, TimeoutError) as e:
                self._nccl.pop(request.channel_id, None)
                channel.close(abort=True)
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"NCCL send failed: {e!r}")
            except asyncio.CancelledError:
                # The decode side gave up mid-send (its pull timed out, its request was
                # cancelled) and aborted its end: a send half done leaves the channel
                # unusable, so it goes, communicator and gathered copy with it.
                self._nccl.pop(request.channel_id, None)
                channel.close(abort=True)
                raise
        return worker_pb2.PullResponse(num_bytes=num_bytes)

    async def _pull_ipc(
        self, request: worker_pb2.PullRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PullResponse:
        """Pin the request's held blocks for the decode side's copy (until FinishPull)."""
        channel = self._ipc[request.channel_id]
        channel.expire()
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(
                self._nccl_executor(), self.read_blocks, request.request_id
            )
        except KeyError:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no KV held for request {request.request_id!r}"
            )
        if not isinstance(result, CacheBlocks) or result.kv_cache is not self._kv_cache:
            finished_with(result)
            await context.abort(
                grpc.StatusCode.INTERNAL, "cuda_ipc serves only blocks of the shared cache"
            )
        assert isinstance(result, CacheBlocks)
        block_ids = channel.pin(request.request_id, result)
        return worker_pb2.PullResponse(
            num_bytes=self.layout.block_nbytes(len(block_ids)), block_ids=block_ids
        )

    async def FinishPull(
        self, request: worker_pb2.FinishPullRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.FinishPullResponse:
        channel = self._ipc.get(request.channel_id)
        if channel is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no cuda_ipc channel {request.channel_id!r}"
            )
        self._idle.touch(request.channel_id)
        if not channel.finish(request.request_id):
            logger.warning("FinishPull of %s: not pinned (expired?)", request.request_id)
        return worker_pb2.FinishPullResponse()

    def _read_gathered(self, request_id: str) -> torch.Tensor:
        """`read_blocks` as one contiguous tensor; cache blocks are gathered into a copy
        (ordered before any later write on the device's stream), then unpinned."""
        result = self.read_blocks(request_id)
        try:
            if isinstance(result, CacheBlocks):
                result.check(self.layout)
                return result.gather()
            check_shape(result, self.layout, "read_blocks result")
            return result
        finally:
            finished_with(result)

    async def CloseChannel(
        self, request: worker_pb2.CloseChannelRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.CloseChannelResponse:
        self._idle.forget(request.channel_id)
        ipc = self._ipc.pop(request.channel_id, None)
        if ipc is not None:
            ipc.close()
            return worker_pb2.CloseChannelResponse()
        channel = self._nccl.pop(request.channel_id, None)
        if channel is not None:
            async with channel.lock:
                # Abort, not destroy: the decode side may have aborted its end already.
                channel.close(abort=True)
        elif not self._tcp.close_channel(request.channel_id):
            logger.debug("CloseChannel of unknown channel %s", request.channel_id)
        return worker_pb2.CloseChannelResponse()

    def _nccl_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix=self._thread_prefix
            )
        return self._executor
