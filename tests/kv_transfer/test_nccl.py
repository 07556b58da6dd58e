"""The nccl backend: import-safe without CUDA; a real 2-GPU transfer when there is one."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tandem.kv_transfer import KvPullError, KvTransferClient, KvTransferError
from tandem.kv_transfer.nccl import NCCL_UNIQUE_ID_BYTES, NcclError, NcclUniqueId, load_nccl
from tandem.kv_transfer.service import KvTransferService
from tandem.proto.tandem.worker.v1 import worker_pb2
from tests.helpers.kv_transfer_harness import (
    SMALL,
    TINY,
    FakeEngine,
    bits,
    prefill_server,
    random_cache,
)
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


def test_unique_id_struct_matches_nccl_abi() -> None:
    assert NCCL_UNIQUE_ID_BYTES == 128
    uid = NcclUniqueId.from_buffer_copy(bytes(range(128)))
    assert bytes(uid.internal) == bytes(range(128))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_without_cuda_the_nccl_backend_fails_cleanly() -> None:
    with pytest.raises(NcclError, match="CUDA"):
        load_nccl()
    engine = FakeEngine(random_cache(TINY, 4), {"r": [1]})

    async def run() -> None:
        async with prefill_server(TINY, engine.read_blocks) as prefill:
            client = KvTransferClient(TINY, "decode-0", backend="nccl")
            try:
                with pytest.raises(KvTransferError, match="needs CUDA"):
                    await client.pull(prefill.handle(TINY, "r", [1]))
                assert client.stats().num_open_channels == 0
            finally:
                await client.close()

    asyncio.run(run())


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="NCCL refuses two ranks on one GPU: needs 2 CUDA devices",
)
def test_nccl_pulls_between_two_gpus_are_bit_exact() -> None:
    layout = SMALL
    cache = random_cache(layout, 300).to("cuda:1")
    engine = FakeEngine(cache, {"a": list(range(0, 300, 2)), "b": [7]})

    async def run() -> None:
        async with prefill_server(layout, engine.read_blocks, device="cuda:1") as prefill:
            client = KvTransferClient(layout, "decode-0", backend="nccl", device="cuda:0")
            try:
                for _ in range(2):
                    for request_id, ids in engine.held.items():
                        got = await client.pull(prefill.handle(layout, request_id, ids))
                        assert got.device == torch.device("cuda:0")
                        want = engine.expected(request_id).to("cuda:0")
                        assert torch.equal(bits(got), bits(want))
                assert client.stats().num_open_channels == 1
                # Not found: the posted recv forces a new communicator, then pulls work.
                with pytest.raises(KvPullError):
                    await client.pull(prefill.handle(layout, "gone", [1]))
                got = await client.pull(prefill.handle(layout, "b", [7]))
                assert torch.equal(bits(got), bits(engine.expected("b").to("cuda:0")))
                assert client.stats().num_open_channels == 1
            finally:
                await client.close()
            # CloseChannel RPCs of the aborted and the last channel.
            await wait_until(
                lambda: prefill.service.stats().num_open_channels == 0,
                timeout_s=1.0,
                what="the prefill side to close both channels",
            )

    asyncio.run(run())


class StalledSend:
    """An NCCL channel whose send never ends (the decode side stopped receiving)."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.sending = asyncio.Event()
        self.closed_with_abort: bool | None = None

    async def send(self, blocks: torch.Tensor) -> int:
        self.sending.set()
        await asyncio.Event().wait()  # cancelled by the test, as gRPC cancels the handler
        return 0

    def close(self, abort: bool = False) -> None:
        self.closed_with_abort = abort


def test_a_pull_cancelled_mid_send_drops_its_nccl_channel() -> None:
    """The decode side gives up during a send (its pull timed out, its request was
    cancelled) and aborts its end: the prefill side's handler, cancelled by gRPC, drops
    the channel (communicator, gathered copy) instead of keeping it until stop."""
    engine = FakeEngine(random_cache(TINY, 4), {"r": [1, 2]})
    service = KvTransferService(TINY, engine.read_blocks)
    channel = StalledSend()
    service._nccl["ch"] = channel  # what OpenChannel adds (it needs CUDA and NCCL)

    async def scenario() -> None:
        pull = asyncio.ensure_future(
            service.Pull(worker_pb2.PullRequest(channel_id="ch", request_id="r"), None)
        )
        async with asyncio.timeout(10):
            await channel.sending.wait()
        pull.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pull
        # Dropped by the cancelled pull, not (only) by the service's stop.
        assert channel.closed_with_abort is True
        assert "ch" not in service._nccl
        await service.stop()

    asyncio.run(scenario())
