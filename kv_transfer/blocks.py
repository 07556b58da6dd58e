"""What a prefill worker hands to the service, and how it becomes a payload.

`read_blocks(request_id)` returns either
* a tensor `[layers, 2, n, block_size, kv_heads, head_dim]` (e.g. `Engine.export_kv`'s
  copy), sent as is; or
* `CacheBlocks(kv_cache, block_ids, on_done)` (e.g. `Engine.acquire_held_kv`'s pinned
  blocks, what prefill workers serve): zero-copy, sent straight from the cache (see
  `PayloadReader`). The blocks stay pinned until the transfer calls `on_done`, exactly
  once, when it stops reading them: sent, failed, refused or cut off.
It raises KeyError when the request holds no KV. It is called from transfer threads.

The same type names a decode worker's reserved blocks, the destination of
`KvTransferClient.pull(handle, out=...)`; its `on_done` is called once the transfer
stops writing them.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.kv_transfer.iovec import Iovecs
from tandem.kv_transfer.layout import KvLayout, dtype_name
from tandem.kv_transfer.wire import DataReply, byte_view, send_payload


@dataclass(frozen=True)
class CacheBlocks:
    """A request's blocks inside a worker's paged cache: the prefill side's held blocks
    (a pull's source; they must stay pinned until it completes) or the decode side's
    reserved blocks (a pull's destination, `KvTransferClient.pull(handle, out=...)`)."""

    # The whole cache: [layers, 2, num_blocks_total, block_size, kv_heads, head_dim].
    kv_cache: torch.Tensor
    # The request's blocks in position order.
    block_ids: list[int]
    # Called once by the transfer when it stops touching the blocks (their unpin).
    on_done: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def done(self) -> None:
        """The transfer no longer touches these blocks (calls `on_done`, if any)."""
        if self.on_done is not None:
            self.on_done()

    def check(self, layout: KvLayout) -> None:
        """ValueError unless the cache has the layout and every block id is in it."""
        check_shape(self.kv_cache, layout, "kv_cache")
        total = self.kv_cache.shape[2]
        bad = [b for b in self.block_ids if not 0 <= b < total]
        if bad:
            raise ValueError(f"block ids {bad[:8]} outside the cache's {total} blocks")

    def gather(self) -> torch.Tensor:
        """A contiguous copy [layers, 2, len(block_ids), ...] on the cache's device."""
        return self.kv_cache.index_select(2, self._ids())

    def scatter(self, blocks: torch.Tensor) -> None:
        """Write `blocks` [layers, 2, len(block_ids), ...] into these blocks."""
        self.kv_cache.index_copy_(2, self._ids(), blocks.to(self.kv_cache.device))

    def _ids(self) -> torch.Tensor:
        return torch.tensor(self.block_ids, dtype=torch.long, device=self.kv_cache.device)

    @property
    def is_scatterable(self) -> bool:
        """Sockets can read/write these blocks in place (contiguous CPU cache)."""
        return self.kv_cache.device.type == "cpu" and self.kv_cache.is_contiguous()


ReadBlocks = Callable[[str], "torch.Tensor | CacheBlocks"]


def finished_with(result: torch.Tensor | CacheBlocks | None) -> None:
    """A `read_blocks` result is no longer used (unpins `CacheBlocks`)."""
    if isinstance(result, CacheBlocks):
        result.done()


def check_shape(tensor: torch.Tensor, layout: KvLayout, what: str) -> None:
    """ValueError unless `tensor` is [layers, 2, *, block_size, heads, dim] of the layout."""
    expected = layout.block_shape(tensor.shape[2] if tensor.dim() == 6 else 0)
    if tuple(tensor.shape) != expected or tensor.dtype != layout.torch_dtype:
        raise ValueError(
            f"{what} is {tuple(tensor.shape)} {tensor.dtype}, layout wants "
            f"{(*expected[:2], 'n', *expected[3:])} {layout.torch_dtype}"
        )


# Sends the payload on a socket, by a deadline (monotonic s); returns the bytes sent.
SendPayload = Callable[[socket.socket, float], int]


class PayloadReader:
    """Turns `read_blocks` results into a reply and a function that sends the payload.

    `CacheBlocks` of a contiguous CPU cache go out by vectored send straight from the
    cache (`block_iovecs`: runs of adjacent blocks merged): no gather copy at all. A
    CUDA (or strided) cache is gathered one (layer, K/V) slab at a time into a staging
    buffer that this reader (one per connection) reuses across pulls."""

    def __init__(self, layout: KvLayout) -> None:
        self.layout = layout
        self._staging = torch.empty(0, dtype=layout.torch_dtype)

    def prepare(self, result: torch.Tensor | CacheBlocks) -> tuple[DataReply, SendPayload]:
        """ValueError when the result does not fit the layout (nothing is sent then)."""
        if isinstance(result, CacheBlocks):
            return self._prepare_held(result)
        check_shape(result, self.layout, "read_blocks result")
        blocks = result.detach().to("cpu").contiguous()
        reply = self._reply(tuple(blocks.shape), blocks.nbytes)
        return reply, lambda sock, deadline: send_payload(sock, [byte_view(blocks)], deadline)

    def _prepare_held(self, held: CacheBlocks) -> tuple[DataReply, SendPayload]:
        held.check(self.layout)
        cache = held.kv_cache
        num_blocks = len(held.block_ids)
        reply = self._reply(
            self.layout.block_shape(num_blocks), self.layout.block_nbytes(num_blocks)
        )
        if held.is_scatterable:
            return reply, block_iovecs(held).send
        return reply, lambda sock, deadline: send_payload(
            sock, self._gather(cache, held.block_ids), deadline
        )

    def _gather(self, cache: torch.Tensor, block_ids: list[int]) -> Iterator[memoryview]:
        """One slab [n, block_size, heads, dim] at a time, in payload order."""
        if not block_ids:
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
        shape = (len(block_ids), *cache.shape[3:])
        if self._staging.numel() < math.prod(shape):
            self._staging = torch.empty(math.prod(shape), dtype=self.layout.torch_dtype)
        slab = self._staging[: math.prod(shape)].view(shape)
        for layer in range(cache.shape[0]):
            for kv in range(2):
                if cache.is_cuda:
                    slab.copy_(cache[layer, kv].index_select(0, ids))
                else:
                    torch.index_select(cache[layer, kv], 0, ids, out=slab)
                yield byte_view(slab)

    def _reply(self, shape: tuple[int, ...], nbytes: int) -> DataReply:
        return DataReply(
            status="ok", shape=shape, dtype=dtype_name(self.layout.torch_dtype), nbytes=nbytes
        )


def block_iovecs(blocks: CacheBlocks) -> Iovecs:
    """Byte ranges of a payload inside a contiguous CPU cache, in payload order
    ([layers, 2, blocks, ...]): one per run of adjacent block ids per (layer, K/V),
    computed vectorised (no per-block Python work)."""
    cache = blocks.kv_cache
    ids = np.asarray(blocks.block_ids, dtype=np.int64)
    if not ids.size:
        return Iovecs(cache, ids, ids)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1  # where a new run begins
    run_first = ids[np.concatenate(([0], breaks))]
    run_blocks = np.diff(np.concatenate(([0], breaks, [ids.size])))
    block_nbytes = math.prod(cache.shape[3:]) * cache.element_size()
    slab_first = np.arange(cache.shape[0] * 2, dtype=np.int64)[:, None] * cache.shape[2]
    offsets = (slab_first + run_first) * block_nbytes
    return Iovecs(cache, offsets, np.broadcast_to(run_blocks * block_nbytes, offsets.shape))
