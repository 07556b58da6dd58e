"""The `nccl` backend's channels: one 2-rank communicator per (decode, prefill) pair.

Open: the decode side makes the unique id and sends it in `OpenChannel`; after the
reply both sides run `ncclCommInitRank` concurrently in a thread (rank 0 = decode,
rank 1 = prefill). Pull: the decode side posts `ncclRecv` into a preallocated CUDA
tensor on a side stream, then calls the `Pull` RPC, on which the prefill side gathers
the blocks and `ncclSend`s them on its side stream; both wait (bounded) for their
stream. A posted recv cannot be withdrawn, so any failed pull (including "not found")
aborts the communicator and the channel; the next pull opens a new one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

import torch

from tandem.kv_transfer.errors import KvPullError
from tandem.kv_transfer.layout import KvLayout
from tandem.kv_transfer.nccl import NcclComm, NcclError, load_nccl

logger = logging.getLogger(__name__)

DECODE_RANK, PREFILL_RANK = 0, 1


async def wait_event(event: torch.cuda.Event, timeout_s: float) -> None:
    """Poll a CUDA event without blocking the event loop; TimeoutError past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError("NCCL transfer did not complete in time")
        await asyncio.sleep(0.0002)


class NcclClientChannel:
    """Decode side (rank 0)."""

    def __init__(self, channel_id: str, comm: NcclComm, layout: KvLayout, timeout_s: float):
        self.channel_id = channel_id
        self.comm = comm
        self.layout = layout
        self.timeout_s = timeout_s
        self._open = True

    @staticmethod
    def new_unique_id() -> bytes:
        return load_nccl().unique_id()

    @classmethod
    async def init(
        cls,
        channel_id: str,
        unique_id: bytes,
        layout: KvLayout,
        device: torch.device,
        timeout_s: float,
        executor: concurrent.futures.Executor,
    ) -> NcclClientChannel:
        """Join the communicator the prefill side is joining now (after OpenChannel)."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(
            executor, NcclComm.init, load_nccl(), unique_id, 2, DECODE_RANK, device
        )
        try:
            comm = await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except (TimeoutError, NcclError) as e:
            _abort_when_ready(future)
            raise KvPullError(f"NCCL channel {channel_id} init failed: {e!r}") from e
        return cls(channel_id, comm, layout, timeout_s)

    @property
    def is_open(self) -> bool:
        return self._open

    def post_recv(self, out: torch.Tensor) -> torch.cuda.Event:
        return self.comm.recv(out, PREFILL_RANK)

    async def finish_recv(self, event: torch.cuda.Event) -> None:
        await wait_event(event, self.timeout_s)

    def abort(self) -> None:
        """A posted recv may be pending: abort the communicator, never reuse it."""
        if self._open:
            self._open = False
            self.comm.close(abort=True)

    def close(self, wait_s: float = 1.0) -> None:
        if self._open:
            self._open = False
            self.comm.close()


class NcclServerChannel:
    """Prefill side (rank 1); its init runs in a thread while the decode side inits."""

    def __init__(self, channel_id: str, device: torch.device, timeout_s: float) -> None:
        self.channel_id = channel_id
        self.device = device
        self.timeout_s = timeout_s
        self.lock = asyncio.Lock()
        self._init: asyncio.Future[NcclComm] | None = None
        self._comm: NcclComm | None = None

    def start_init(self, unique_id: bytes, executor: concurrent.futures.Executor) -> None:
        loop = asyncio.get_running_loop()
        self._init = loop.run_in_executor(
            executor, NcclComm.init, load_nccl(), unique_id, 2, PREFILL_RANK, self.device
        )

    async def send(self, blocks: torch.Tensor) -> int:
        """Send `blocks` to the decode side; returns the bytes sent. NcclError/TimeoutError
        leave the channel unusable (the caller closes it with abort=True)."""
        if self._comm is None:
            if self._init is None:
                raise NcclError(f"NCCL channel {self.channel_id} was never initialised")
            self._comm = await asyncio.wait_for(asyncio.shield(self._init), self.timeout_s)
        blocks = blocks.to(self.device).contiguous()
        await wait_event(self._comm.send(blocks, DECODE_RANK), self.timeout_s)
        return blocks.nbytes

    def close(self, abort: bool = False) -> None:
        init = self._init
        if self._comm is None and init is not None and init.done() and not init.cancelled():
            self._comm = None if init.exception() else init.result()
        if self._comm is not None:
            self._comm.close(abort=abort)
            self._comm = None
        elif self._init is not None and not self._init.done():
            logger.warning("NCCL channel %s closed during its init", self.channel_id)
            _abort_when_ready(self._init)


def _abort_when_ready(init: asyncio.Future[NcclComm]) -> None:
    """An init that outlived its waiter: its thread cannot be interrupted (it ends with
    NCCL's own bootstrap timeout), but a communicator it still makes is aborted."""

    def done(future: asyncio.Future[NcclComm]) -> None:
        if not future.cancelled() and future.exception() is None:
            future.result().close(abort=True)

    init.add_done_callback(done)
