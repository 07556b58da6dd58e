"""Prefill side of KV transfer: the `KvTransfer` gRPC service (control plane).

`OpenChannel` checks the layout fingerprint (FAILED_PRECONDITION on mismatch, with
every differing field) and sets up the data plane of the chosen backend: for TCP the
host:port of the service's data server (one socket per channel), for NCCL a 2-rank
communicator. `Pull` is NCCL's send trigger (TCP pulls on its socket).
`CloseChannel` frees a channel; `stop()` frees everything.
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
from tandem.kv_transfer.errors import LayoutMismatchError
from tandem.kv_transfer.layout import KvLayout
from tandem.kv_transfer.nccl import NCCL_UNIQUE_ID_BYTES, NcclError, load_nccl
from tandem.kv_transfer.nccl_channel import PREFILL_RANK, NcclServerChannel
from tandem.kv_transfer.stats import TransferStats, count_threads, wait_threads_gone
from tandem.kv_transfer.tcp_server import TcpDataServer
from tandem.proto.cluster_auth import ClusterAuth
from tandem.proto.tandem.worker.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


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
    ) -> None:
        """`read_blocks(request_id)`: see `kv_transfer.blocks` (called from transfer
        threads, so it must be thread-safe; KeyError when nothing is held).
        `advertise_host`: the data server's address as decode workers reach it (default
        `host`). `device`: CUDA device of NCCL channels (default the current one).
        `auth`: the cluster token every TCP data connection must prove (the gRPC calls
        are checked by the server's interceptor, see `tandem.proto.cluster_auth`);
        `on_refused` is called (from a transfer thread) for each connection refused."""
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
        self._thread_prefix = f"kv-service-{id(self):x}"
        # NCCL init and GPU gathers only; created on the first NCCL channel.
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._stopped = False

    def start(self) -> str:
        """Start the TCP data server now (else on the first TCP channel); its host:port."""
        return self._tcp.start()

    async def stop(self) -> None:
        """Close every channel, the data server, its sockets and threads."""
        self._stopped = True
        for channel in self._nccl.values():
            channel.close(abort=True)
        self._nccl.clear()
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
            num_open_channels=self._tcp.num_channels + len(self._nccl),
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
        if backend == worker_pb2.KV_BACKEND_NCCL:
            await self._open_nccl(channel_id, request, context)
            return worker_pb2.OpenChannelResponse(channel_id=channel_id, nccl_rank=PREFILL_RANK)
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"backend {backend} is not served over gRPC"
        )
        raise AssertionError("unreachable")  # context.abort raises

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
        logger.info("KV channel %s (nccl) for %s", channel_id, request.decode_worker_id)

    async def Pull(
        self, request: worker_pb2.PullRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PullResponse:
        channel = self._nccl.get(request.channel_id)
        if channel is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no NCCL channel {request.channel_id!r}"
            )
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
        return worker_pb2.PullResponse(num_bytes=num_bytes)

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
