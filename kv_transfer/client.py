"""Decode side of KV transfer: pull a prefilled request's blocks from its prefill worker.

One channel per prefill worker (keyed by worker id and endpoint), opened on the first
pull (in a task of the client's, which a cancelled pull leaves running) and reused; pulls
to one prefill worker are serialised on its channel (each one already saturates the
link). Blocking socket work runs in a small executor the client owns. A channel that
breaks is dropped and the next pull opens a new one; so is one no pull has used for
`idle_close_s`: its prefill worker may be gone for good (replaced, drained, scaled
away), and nothing else would ever close its socket.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from typing import Any

import grpc
import torch

from tandem.kv_transfer.blocks import CacheBlocks
from tandem.kv_transfer.buffers import BufferPool
from tandem.kv_transfer.cuda_ipc import Placement
from tandem.kv_transfer.cuda_ipc_channel import CudaIpcClientChannel, pull_over_ipc
from tandem.kv_transfer.errors import KvPullError, KvTransferError, LayoutMismatchError
from tandem.kv_transfer.handle import KvHandle
from tandem.kv_transfer.idle_channels import DECODE_IDLE_CLOSE_S, IdleChannels
from tandem.kv_transfer.layout import KvLayout
from tandem.kv_transfer.local import LocalChannel, LocalRegistry
from tandem.kv_transfer.nccl import NcclError
from tandem.kv_transfer.nccl_channel import NcclClientChannel
from tandem.kv_transfer.stats import TransferStats, count_threads, wait_threads_gone
from tandem.kv_transfer.tcp_channel import TcpChannel
from tandem.proto.cluster_auth import ClusterAuth, internal_channel
from tandem.proto.tandem.worker.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

BACKENDS = {
    "tcp": worker_pb2.KV_BACKEND_TCP,
    "nccl": worker_pb2.KV_BACKEND_NCCL,
    "local": worker_pb2.KV_BACKEND_LOCAL,
    "cuda_ipc": worker_pb2.KV_BACKEND_CUDA_IPC,
    # The prefill side picks per pair (see `kv_transfer.cuda_ipc.choose_channel_backend`).
    "auto": worker_pb2.KV_BACKEND_AUTO,
}
Channel = TcpChannel | LocalChannel | NcclClientChannel | CudaIpcClientChannel
_ChannelKey = tuple[str, str]  # (prefill worker id, endpoint)


class KvTransferClient:
    """Pulls KV for one decode worker."""

    def __init__(
        self,
        layout: KvLayout,
        worker_id: str,
        backend: str = "tcp",
        timeout_s: float = 30.0,
        *,
        local_registry: LocalRegistry | None = None,
        device: str | None = None,
        max_num_threads: int = 4,
        max_pooled_bytes: int = 1 << 30,
        auth: ClusterAuth | None = None,
        idle_close_s: float = DECODE_IDLE_CLOSE_S,
    ) -> None:
        """`local_registry`: required by the local backend. `device`: CUDA device of NCCL
        receive buffers (default the current one). `max_pooled_bytes`: idle receive
        memory kept for reuse (see `kv_transfer.buffers`; 0 = none). Every socket and
        RPC wait is bounded by `timeout_s`. `auth`: the cluster token (and TLS) of every
        call and data connection to prefill workers (default: none). `idle_close_s`: a
        channel unused this long is closed."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
        if backend == "local" and local_registry is None:
            raise ValueError("the local backend needs a local_registry")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.layout = layout
        self.worker_id = worker_id
        self.backend = backend
        self.timeout_s = timeout_s
        self._registry = local_registry
        self._auth = auth or ClusterAuth()
        self._device = device
        self._thread_prefix = f"kv-client-{id(self):x}"
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_num_threads, thread_name_prefix=self._thread_prefix
        )
        self._channels: dict[_ChannelKey, Channel] = {}
        # Channels being opened: the client owns each opening until its channel is stored.
        self._opening: dict[_ChannelKey, asyncio.Task[Channel]] = {}
        self._locks: dict[_ChannelKey, asyncio.Lock] = {}
        # When each channel was opened or a pull on it ended.
        self._idle = IdleChannels[_ChannelKey](idle_close_s)
        # Closes idle channels; started by the first pull.
        self._idle_closer: asyncio.Task[None] | None = None
        self._grpc: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._buffers = BufferPool(max_pooled_bytes)
        self._closed = False

    async def pull(
        self, handle: KvHandle, out: torch.Tensor | CacheBlocks | None = None
    ) -> torch.Tensor:
        """The handle's blocks `[layers, 2, len(block_ids), block_size, heads, dim]`.

        By default a new tensor on recycled memory (`kv_transfer.buffers`). `out`
        receives them instead: a contiguous tensor of that shape, or
        `CacheBlocks(kv_cache, block_ids, on_done)`, the decode engine's reserved blocks
        (`Engine.acquire_import_kv`), written in place (tcp and a CPU cache: straight
        from the socket), then `kv_cache` is returned and no `write_kv` is needed.
        `out.done()` is then called exactly once, when nothing writes into the blocks any
        more: after the pull, or after a failed or cancelled one's thread has stopped.
        Raises LayoutMismatchError, KvPullError (KV gone, peer dead or timed out)."""
        if not isinstance(out, CacheBlocks):
            return await self._pull(handle, out)
        writer = _Writer(out)
        try:
            return await self._pull(handle, out, writer)
        finally:
            if not writer.handed_off:
                out.done()

    async def _pull(
        self,
        handle: KvHandle,
        out: torch.Tensor | CacheBlocks | None,
        writer: _Writer | None = None,
    ) -> torch.Tensor:
        self.layout.check_matches(
            handle.layout_fingerprint, self_role="decode", other_role="prefill"
        )
        if self._closed:
            raise KvTransferError("KV transfer client is closed")
        self._check_out(out, handle.num_blocks)
        if writer is not None and not (self.backend == "tcp" and writer.blocks.is_scatterable):
            await writer.run(self._executor, writer.blocks.scatter, await self._pull(handle, None))
            return writer.blocks.kv_cache
        key = (handle.worker_id, handle.endpoint)
        if self._idle_closer is None:
            self._idle_closer = asyncio.create_task(self._close_idle_channels())
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            if self._closed:  # closed while this pull waited for the channel
                raise KvTransferError("KV transfer client is closed")
            channel = await self._channel_to(key, handle)
            self._idle.touch(key)
            try:
                if writer is not None and isinstance(channel, TcpChannel):
                    return await writer.run(
                        self._executor, channel.pull, handle.request_id, handle.num_blocks, out
                    )
                return await self._pull_on(channel, handle, out)
            except KvPullError:
                if not channel.is_open:
                    self._drop(key)
                raise
            except asyncio.CancelledError:
                channel.abort()  # the transfer thread then fails and closes the socket
                self._drop(key)
                raise
            finally:
                self._idle.touch(key)

    async def _channel_to(self, key: _ChannelKey, handle: KvHandle) -> Channel:
        """The open channel to the handle's prefill worker, opened first if needed (under
        the worker's lock). The opening runs in a task of the client's: a pull cancelled
        meanwhile leaves the channel, once open, to the next pull (or to `close`), never
        half-open on the prefill side (opened there, never connected)."""
        channel = self._channels.get(key)
        if channel is not None and channel.is_open:
            return channel
        self._drop(key)
        opening = self._opening.get(key)
        if opening is None:
            opening = asyncio.create_task(self._open(handle))
            self._opening[key] = opening
            opening.add_done_callback(functools.partial(self._opened, key))
        return await asyncio.shield(opening)

    def _opened(self, key: _ChannelKey, opening: asyncio.Task[Channel]) -> None:
        self._opening.pop(key, None)
        if not opening.cancelled() and opening.exception() is None:
            self._channels[key] = opening.result()
            self._idle.touch(key)

    def close_idle(self) -> int:
        """Close the channels no pull has used for `idle_close_s`; how many. Their
        CloseChannel calls run in tasks `close` waits for."""
        idle = []
        for key in self._idle.idle():
            if key not in self._channels:  # dropped (broken, cancelled) since
                self._idle.forget(key)
            elif not self._locks[key].locked():
                idle.append(key)
        for key in idle:
            channel = self._channels.pop(key)
            del self._locks[key]
            self._idle.forget(key)
            task = asyncio.create_task(self._close_channel(key[1], channel))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return len(idle)

    async def _close_idle_channels(self) -> None:
        while True:
            await asyncio.sleep(self._idle.idle_close_s / 4)
            if num_closed := self.close_idle():
                logger.info("closed %d KV channel(s) idle for %g s", num_closed,
                            self._idle.idle_close_s)  # fmt: skip

    async def _close_channel(self, endpoint: str, channel: Channel) -> None:
        """Close one channel at both ends; the endpoint's gRPC channel too when no other
        channel uses it (a prefill worker gone for good leaves nothing behind)."""
        try:
            await self._close_remote(endpoint, channel)
        finally:
            channel.close()
            if all(key[1] != endpoint for key in (*self._channels, *self._opening)):
                await self._forget_grpc(endpoint)

    async def close(self) -> None:
        """Close every channel (CloseChannel RPC, sockets, gRPC channels) and threads."""
        self._closed = True
        if self._idle_closer is not None:
            self._idle_closer.cancel()
            await asyncio.gather(self._idle_closer, return_exceptions=True)
        # Channels still opening join the others (each opening is bounded by timeout_s).
        await asyncio.gather(*self._opening.values(), return_exceptions=True)
        channels = list(self._channels.items())
        self._channels.clear()
        for _, channel in channels:
            if isinstance(channel, TcpChannel):
                channel.abort()  # in-flight pulls fail now
        await asyncio.gather(
            *(self._close_remote(key[1], ch) for key, ch in channels if ch.channel_id),
            *self._closing,
            return_exceptions=True,
        )
        for _, channel in channels:
            channel.close()
        for grpc_channel in self._grpc.values():
            await grpc_channel.close()
        self._grpc.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._buffers.close()
        if await wait_threads_gone(self._thread_prefix, self.timeout_s):
            logger.warning("KV transfer threads still running after close")

    def stats(self) -> TransferStats:
        return TransferStats(
            num_open_channels=len(self._channels),
            num_transfer_threads=count_threads(self._thread_prefix),
        )

    # ----- channels -----------------------------------------------------------------

    async def _open(self, handle: KvHandle) -> Channel:
        if self.backend == "local":
            assert self._registry is not None
            return LocalChannel.open(self._registry, handle.worker_id, self.layout)
        place = Placement.here(self._cuda_device() if torch.cuda.is_available() else None)
        request = worker_pb2.OpenChannelRequest(
            decode_worker_id=self.worker_id,
            layout_fingerprint=self.layout.fingerprint(),
            backend=BACKENDS[self.backend],
            node_id=place.node_id,
            pid=place.pid,
            gpu_uuid=place.gpu_uuid,
        )
        if self.backend == "nccl":
            request.nccl_unique_id = NcclClientChannel.new_unique_id()
        elif self.backend == "auto" and place.gpu_uuid:
            try:  # offered in case the prefill side picks nccl
                request.nccl_unique_id = NcclClientChannel.new_unique_id()
            except NcclError as e:
                logger.info("NCCL not offered: %s", e)
        response = await self._open_rpc(handle.endpoint, request)
        chosen = response.backend or BACKENDS[self.backend]
        try:
            if chosen == worker_pb2.KV_BACKEND_CUDA_IPC:
                return await self._run(
                    CudaIpcClientChannel.open,
                    response.channel_id,
                    response.cuda_ipc_cache,
                    self.layout,
                )
            if chosen == worker_pb2.KV_BACKEND_NCCL:
                return await NcclClientChannel.init(
                    response.channel_id,
                    request.nccl_unique_id,
                    self.layout,
                    self._cuda_device(),
                    self.timeout_s,
                    self._executor,
                )
            return await self._run(
                TcpChannel.connect,
                response.channel_id,
                response.tcp_endpoint,
                self.layout,
                self.timeout_s,
                self._buffers,
                self._auth,
            )
        except KvTransferError:  # a pull error, or a cuda_ipc GPU not visible here
            await self._close_rpc(handle.endpoint, response.channel_id)
            raise

    async def _open_rpc(
        self, endpoint: str, request: worker_pb2.OpenChannelRequest
    ) -> worker_pb2.OpenChannelResponse:
        try:
            return await self._stub(endpoint).OpenChannel(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details()
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                raise LayoutMismatchError(details) from None
            if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT):
                raise KvTransferError(f"OpenChannel to {endpoint}: {details}") from None
            if code == grpc.StatusCode.UNAUTHENTICATED:
                # Retrying with the same token cannot help: the workers' configs differ.
                raise KvTransferError(
                    f"OpenChannel to {endpoint} refused: {details} (do both workers have "
                    "the same cluster token?)"
                ) from None
            await self._forget_grpc(endpoint)  # reconnect afresh next time
            raise KvPullError(f"OpenChannel to {endpoint} failed: {code.name} {details}") from e

    async def _pull_on(
        self, channel: Channel, handle: KvHandle, out: torch.Tensor | CacheBlocks | None
    ) -> torch.Tensor:
        if isinstance(channel, CudaIpcClientChannel):
            target = out if isinstance(out, torch.Tensor) else None
            return await pull_over_ipc(
                channel, self._stub(handle.endpoint), handle, target, self.timeout_s, self._run
            )
        if not isinstance(channel, NcclClientChannel):
            return await self._run(channel.pull, handle.request_id, handle.num_blocks, out)
        shape = self.layout.block_shape(handle.num_blocks)
        if not isinstance(out, torch.Tensor):
            out = torch.empty(shape, dtype=self.layout.torch_dtype, device=channel.comm.device)
        try:
            done = channel.post_recv(out)
            response = await self._stub(handle.endpoint).Pull(
                worker_pb2.PullRequest(channel_id=channel.channel_id, request_id=handle.request_id),
                timeout=self.timeout_s,
            )
            if response.num_bytes != out.nbytes:
                raise KvPullError(f"prefill sent {response.num_bytes} bytes, expected {out.nbytes}")
            await channel.finish_recv(done)
        except (grpc.aio.AioRpcError, TimeoutError, KvTransferError) as e:
            channel.abort()
            task = asyncio.create_task(self._close_rpc(handle.endpoint, channel.channel_id))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            if isinstance(e, KvPullError):
                raise
            raise KvPullError(f"NCCL pull of {handle.request_id!r} failed: {e!r}") from e
        return out

    def _drop(self, key: _ChannelKey) -> None:
        channel = self._channels.pop(key, None)
        if channel is not None:
            channel.abort()

    async def _close_remote(self, endpoint: str, channel: Channel) -> None:
        if not isinstance(channel, LocalChannel):
            await self._close_rpc(endpoint, channel.channel_id)

    async def _close_rpc(self, endpoint: str, channel_id: str) -> None:
        try:
            await self._stub(endpoint).CloseChannel(
                worker_pb2.CloseChannelRequest(channel_id=channel_id),
                timeout=min(self.timeout_s, 5.0),
            )
        except grpc.aio.AioRpcError as e:
            logger.debug("CloseChannel %s at %s: %s", channel_id, endpoint, e.code().name)

    # ----- helpers ------------------------------------------------------------------

    def _stub(self, endpoint: str) -> worker_pb2_grpc.KvTransferStub:
        if endpoint not in self._grpc:
            self._grpc[endpoint] = internal_channel(endpoint, self._auth, options=())
        return worker_pb2_grpc.KvTransferStub(self._grpc[endpoint])

    async def _forget_grpc(self, endpoint: str) -> None:
        channel = self._grpc.pop(endpoint, None)
        if channel is not None:
            await channel.close()

    async def _run(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def _cuda_device(self) -> torch.device:
        device = torch.device(self._device or "cuda")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def _check_out(self, out: torch.Tensor | CacheBlocks | None, num_blocks: int) -> None:
        if out is None:
            return
        if isinstance(out, CacheBlocks):
            out.check(self.layout)
            if len(out.block_ids) != num_blocks:
                raise ValueError(f"out has {len(out.block_ids)} blocks, pull needs {num_blocks}")
            return
        shape = self.layout.block_shape(num_blocks)
        if tuple(out.shape) != shape or out.dtype != self.layout.torch_dtype:
            raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, pull needs {shape}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        if self.backend == "tcp" and out.device.type != "cpu":
            raise ValueError("the tcp backend receives into CPU memory")


class _Writer:
    """Hands a pull into `CacheBlocks` to a transfer thread and calls `blocks.done()`
    once that thread is finished with them (or will never start)."""

    def __init__(self, blocks: CacheBlocks) -> None:
        self.blocks = blocks
        self.handed_off = False

    async def run(self, executor: concurrent.futures.Executor, fn: Any, *args: Any) -> Any:
        future = executor.submit(functools.partial(fn, *args))
        self.handed_off = True
        # Registered before asyncio's own callback: the blocks are released by the time
        # the await returns. Also runs if the work is cancelled before it starts.
        future.add_done_callback(lambda _: self.blocks.done())
        return await asyncio.wrap_future(future)
