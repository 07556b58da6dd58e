"""Test helpers: a real grpc.aio KvTransfer server on loopback, handles, leak probes."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import torch

from tandem.kv_transfer import CacheBlocks, KvHandle, KvLayout, KvTransferService, ReadBlocks
from tandem.kv_transfer.idle_channels import PREFILL_IDLE_CLOSE_S
from tandem.proto.cluster_auth import ClusterAuth, add_internal_port, internal_server
from tandem.proto.tandem.worker.v1 import worker_pb2_grpc

TINY = KvLayout("tiny-0123abcd", "float32", 4, 2, 2, 8)
# The small preset's layout: 393,216 bytes per fp32 block.
SMALL = KvLayout("tandem-small-0123abcd", "float32", 16, 12, 4, 64)


def random_cache(layout: KvLayout, num_blocks: int, seed: int = 0) -> torch.Tensor:
    """A KV cache whose every bit pattern differs (bf16/fp16 included)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.block_shape(num_blocks), generator=gen).to(layout.torch_dtype)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Integer view for bit-for-bit comparison (NaN-safe, dtype-exact)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.contiguous().view(ints[tensor.element_size()])


@dataclass
class FakeEngine:
    """Held requests -> block ids of one shared cache, like a prefill engine's pool."""

    cache: torch.Tensor
    held: dict[str, list[int]]
    zero_copy: bool = True

    def read_blocks(self, request_id: str) -> torch.Tensor | CacheBlocks:
        ids = self.held[request_id]  # KeyError when not held
        if self.zero_copy:
            return CacheBlocks(self.cache, ids)
        return self.cache.index_select(2, torch.tensor(ids, dtype=torch.long))

    def expected(self, request_id: str) -> torch.Tensor:
        return self.cache[:, :, self.held[request_id]]


@dataclass
class Prefill:
    service: KvTransferService
    server: grpc.aio.Server
    endpoint: str
    worker_id: str = "prefill-0"

    def handle(self, layout: KvLayout, request_id: str, block_ids: list[int]) -> KvHandle:
        return KvHandle(
            worker_id=self.worker_id,
            endpoint=self.endpoint,
            request_id=request_id,
            block_ids=block_ids,
            num_tokens=len(block_ids) * layout.block_size,
            layout_fingerprint=layout.fingerprint(),
            lease_expiry_unix_s=time.time() + 30,
        )

    async def stop(self) -> None:
        await self.service.stop()
        await self.server.stop(None)


@contextlib.asynccontextmanager
async def prefill_server(
    layout: KvLayout,
    read_blocks: ReadBlocks,
    timeout_s: float = 10.0,
    device: str | None = None,
    auth: ClusterAuth | None = None,
    idle_close_s: float = PREFILL_IDLE_CLOSE_S,
) -> AsyncIterator[Prefill]:
    """A KvTransfer server; with `auth`, guarded like a worker's (token interceptor on
    gRPC, token proof on TCP data connections)."""
    auth = auth or ClusterAuth()
    service = KvTransferService(
        layout, read_blocks, timeout_s=timeout_s, device=device, auth=auth,
        idle_close_s=idle_close_s,
    )  # fmt: skip
    server = internal_server(auth, options=())
    worker_pb2_grpc.add_KvTransferServicer_to_server(service, server)
    port = add_internal_port(server, "127.0.0.1:0", auth)
    await server.start()
    prefill = Prefill(service, server, f"127.0.0.1:{port}")
    try:
        yield prefill
    finally:
        await prefill.stop()


def socket_fds() -> set[str]:
    """This process's open socket inodes."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:"):
                fds.add(target)
    return fds


def thread_names() -> set[str]:
    return {t.name for t in threading.enumerate()}
