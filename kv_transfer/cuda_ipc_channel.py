"""The `cuda_ipc` backend's channels: pins on the prefill side, copies on the decode side.

Open: the prefill side answers `OpenChannel` with its cache's CUDA IPC description
(exported once per service; the cache is allocated once); the decode side maps it once
per channel. Pull: the `Pull` RPC pins the request's held blocks and names them; the
decode side copies them device to device out of the mapped cache, waits for the copy,
then calls `FinishPull`, which unpins them. A pin whose `FinishPull` never comes (the
decode worker died) is dropped after `timeout_s`, or when the channel closes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import torch

from tandem.kv_transfer.blocks import CacheBlocks, check_shape
from tandem.kv_transfer.cuda_ipc import CudaIpcCache
from tandem.kv_transfer.errors import KvPullError
from tandem.kv_transfer.handle import KvHandle
from tandem.kv_transfer.layout import KvLayout
from tandem.proto.tandem.worker.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


class CudaIpcServerChannel:
    """Prefill side: the blocks pinned between a `Pull` and its `FinishPull`."""

    def __init__(
        self, channel_id: str, timeout_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.channel_id = channel_id
        self.timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pins: dict[str, tuple[CacheBlocks, float]] = {}  # request -> (blocks, deadline)

    def pin(self, request_id: str, blocks: CacheBlocks) -> list[int]:
        """Keep `blocks` pinned until `finish(request_id)` (or the timeout); their ids.
        A second pull of the same request before its finish replaces the first pin."""
        with self._lock:
            old = self._pins.pop(request_id, None)
            self._pins[request_id] = (blocks, self._clock() + self.timeout_s)
        if old is not None:
            old[0].done()
        return list(blocks.block_ids)

    def finish(self, request_id: str) -> bool:
        """Unpin a pull's blocks; False when none were pinned (finished or expired)."""
        with self._lock:
            entry = self._pins.pop(request_id, None)
        if entry is not None:
            entry[0].done()
        return entry is not None

    def expire(self) -> int:
        """Unpin the pulls past their deadline; how many."""
        now = self._clock()
        with self._lock:
            late = [r for r, (_, deadline) in self._pins.items() if deadline <= now]
            entries = [self._pins.pop(r) for r in late]
        for request_id, (blocks, _) in zip(late, entries, strict=True):
            logger.warning(
                "KV channel %s: no FinishPull for %s; unpinned", self.channel_id, request_id
            )
            blocks.done()
        return len(entries)

    @property
    def num_pinned(self) -> int:
        with self._lock:
            return len(self._pins)

    def close(self) -> None:
        """Unpin everything (the channel is gone)."""
        with self._lock:
            entries, self._pins = list(self._pins.values()), {}
        for blocks, _ in entries:
            blocks.done()


class CudaIpcClientChannel:
    """Decode side: the prefill cache mapped into this process, copied from on pulls."""

    def __init__(self, channel_id: str, remote_cache: torch.Tensor, layout: KvLayout) -> None:
        self.channel_id = channel_id
        self.layout = layout
        self._remote: torch.Tensor | None = remote_cache
        self.device = remote_cache.device

    @classmethod
    def open(cls, channel_id: str, description: bytes, layout: KvLayout) -> CudaIpcClientChannel:
        """Map the prefill cache (blocking); KvPullError/KvTransferError when it cannot be
        mapped or does not have our layout."""
        try:
            remote = CudaIpcCache.from_bytes(description).open()
            check_shape(remote, layout, "the prefill's CUDA IPC cache")
        except (ValueError, RuntimeError) as e:
            raise KvPullError(f"cuda_ipc channel {channel_id}: {e}") from e
        return cls(channel_id, remote, layout)

    @property
    def is_open(self) -> bool:
        return self._remote is not None

    def copy_blocks(self, block_ids: list[int], out: torch.Tensor | None) -> torch.Tensor:
        """The blocks [layers, 2, len(block_ids), ...] copied out of the prefill cache
        (into `out` when given); returns once the copy is complete (blocking)."""
        remote = self._remote
        if remote is None:
            raise KvPullError(f"cuda_ipc channel {self.channel_id} is closed")
        total = remote.shape[2]
        if any(not 0 <= b < total for b in block_ids):
            raise KvPullError(f"prefill named blocks outside its cache of {total}")
        # On this thread's current (default) stream, like the engine's own kernels, so
        # the caching allocator and later scatters see ordinary stream order.
        with torch.cuda.device(self.device):
            ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
            blocks = remote.index_select(2, ids)
            if out is not None:
                out.copy_(blocks)  # to the caller's device when it differs
                blocks = out
            done = torch.cuda.Event()
            done.record()
        done.synchronize()  # the prefill side may reuse the blocks after FinishPull
        return blocks

    def abort(self) -> None:
        self._remote = None

    def close(self, wait_s: float = 1.0) -> None:
        """Drop the mapping (torch unmaps it once no tensor views it)."""
        self._remote = None


async def pull_over_ipc(
    channel: CudaIpcClientChannel,
    stub: worker_pb2_grpc.KvTransferStub,
    handle: KvHandle,
    out: torch.Tensor | None,
    timeout_s: float,
    run: Callable[..., Awaitable[Any]],
) -> torch.Tensor:
    """One pull: the Pull RPC pins and names the blocks, `run` (the client's executor)
    copies them, FinishPull unpins them (also after a failed copy; after a cancelled one
    once its copy thread has finished)."""
    request = worker_pb2.PullRequest(channel_id=channel.channel_id, request_id=handle.request_id)
    try:
        response = await stub.Pull(request, timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.NOT_FOUND:
            channel.abort()  # the next pull reopens (and re-maps) the channel
        raise KvPullError(f"cuda_ipc pull of {handle.request_id!r}: {e.details()}") from e
    copy: asyncio.Future[torch.Tensor] | None = None
    try:
        if len(response.block_ids) != handle.num_blocks:
            raise KvPullError(
                f"prefill pinned {len(response.block_ids)} blocks, handle names {handle.num_blocks}"
            )
        copy = asyncio.ensure_future(run(channel.copy_blocks, list(response.block_ids), out))
        return await asyncio.shield(copy)
    finally:
        if copy is not None and not copy.done():
            # Cancelled: the copy thread still reads the prefill's blocks; unpin after it.
            await asyncio.wait([copy], timeout=timeout_s)
        finish = worker_pb2.FinishPullRequest(
            channel_id=channel.channel_id, request_id=handle.request_id
        )
        try:
            await stub.FinishPull(finish, timeout=min(timeout_s, 5.0))
        except grpc.aio.AioRpcError as e:  # the pin then expires on the prefill side
            logger.warning("FinishPull of %s: %s", handle.request_id, e.code().name)
