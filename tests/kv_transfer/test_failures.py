"""Failures a decode worker must survive: layout mismatch, KV gone, dead or stalled peer."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import torch

from tandem.kv_transfer import (
    CacheBlocks,
    KvHandle,
    KvLayout,
    KvPullError,
    KvTransferClient,
    LayoutMismatchError,
    LocalRegistry,
)
from tandem.kv_transfer.tcp_channel import TcpChannel
from tandem.kv_transfer.wire import DataReply, DataRequest, recv_message, send_message
from tests.helpers.kv_transfer_harness import TINY, FakeEngine, prefill_server, random_cache
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

BF16 = KvLayout(
    TINY.model, "bfloat16", TINY.block_size, TINY.num_layers, TINY.num_kv_heads, TINY.head_dim
)


def make_engine() -> FakeEngine:
    return FakeEngine(random_cache(TINY, 32), {"r1": [1, 2, 3], "r2": [30, 0]})


def test_handle_with_another_layout_is_refused_before_any_channel() -> None:
    engine = make_engine()

    async def run() -> None:
        async with prefill_server(TINY, engine.read_blocks) as prefill:
            client = KvTransferClient(TINY, "decode-0")
            try:
                handle = prefill.handle(BF16, "r1", [1, 2, 3])
                with pytest.raises(
                    LayoutMismatchError, match="dtype: decode=float32 prefill=bfloat16"
                ):
                    await client.pull(handle)
                assert client.stats().num_open_channels == 0
                assert prefill.service.stats().num_open_channels == 0
            finally:
                await client.close()

    asyncio.run(run())


def test_open_channel_checks_the_layout_on_the_prefill_side() -> None:
    engine = FakeEngine(random_cache(BF16, 8), {"r1": [1]})

    async def run() -> None:
        # The prefill worker runs bf16; the handle (wrongly) claims the decode's layout.
        async with prefill_server(BF16, engine.read_blocks) as prefill:
            client = KvTransferClient(TINY, "decode-0")
            try:
                with pytest.raises(LayoutMismatchError) as err:
                    await client.pull(prefill.handle(TINY, "r1", [1]))
                assert str(err.value) == (
                    "KV layout mismatch: dtype: prefill=bfloat16 decode=float32"
                )
                assert client.stats().num_open_channels == 0
                assert prefill.service.stats().num_open_channels == 0
            finally:
                await client.close()

    asyncio.run(run())


def test_local_backend_checks_the_registered_layout() -> None:
    registry = LocalRegistry()
    registry.register("p", BF16, make_engine().read_blocks)

    async def run() -> None:
        client = KvTransferClient(TINY, "d", backend="local", local_registry=registry)
        try:
            with pytest.raises(LayoutMismatchError, match="dtype: decode=float32 prefill=bfloat16"):
                await client.pull(KvHandle("p", "", "r1", [1], 4, TINY.fingerprint()))
            with pytest.raises(KvPullError, match="no local prefill worker"):
                await client.pull(KvHandle("nobody", "", "r1", [1], 4, TINY.fingerprint()))
        finally:
            await client.close()

    asyncio.run(run())


def test_unknown_or_released_request_fails_and_the_channel_keeps_working() -> None:
    engine = make_engine()

    async def run() -> None:
        async with prefill_server(TINY, engine.read_blocks) as prefill:
            client = KvTransferClient(TINY, "decode-0")
            try:
                assert torch.equal(
                    await client.pull(prefill.handle(TINY, "r1", [1, 2, 3])), engine.expected("r1")
                )
                with pytest.raises(KvPullError, match="no KV held for request 'nope'"):
                    await client.pull(prefill.handle(TINY, "nope", [4]))
                del engine.held["r1"]  # released (or its lease expired)
                with pytest.raises(KvPullError, match="expired, released or unknown"):
                    await client.pull(prefill.handle(TINY, "r1", [1, 2, 3]))
                got = await client.pull(prefill.handle(TINY, "r2", [30, 0]))
                assert torch.equal(got, engine.expected("r2"))
                assert client.stats().num_open_channels == 1
                assert prefill.service.stats().num_open_channels == 1
            finally:
                await client.close()

    asyncio.run(run())


def test_stopped_peer_fails_fast_and_the_next_peer_gets_a_new_channel() -> None:
    engine = make_engine()

    async def run() -> None:
        client = KvTransferClient(TINY, "decode-0", timeout_s=5.0)
        try:
            async with prefill_server(TINY, engine.read_blocks) as first:
                await client.pull(first.handle(TINY, "r1", [1, 2, 3]))
                await first.stop()
                for _ in range(2):  # on the broken socket, then on a fresh open attempt
                    start = time.monotonic()
                    with pytest.raises(KvPullError):
                        await client.pull(first.handle(TINY, "r1", [1, 2, 3]))
                    assert time.monotonic() - start < 5.0
                    assert client.stats().num_open_channels == 0
            async with prefill_server(TINY, engine.read_blocks) as second:
                got = await client.pull(second.handle(TINY, "r2", [30, 0]))
                assert torch.equal(got, engine.expected("r2"))
                assert client.stats().num_open_channels == 1
        finally:
            await client.close()

    asyncio.run(run())


def test_stalled_peer_times_out_and_the_channel_reconnects() -> None:
    engine = make_engine()
    stall = threading.Event()

    def read_blocks(request_id: str) -> torch.Tensor | CacheBlocks:
        if request_id == "slow":
            stall.wait(20)
        return engine.read_blocks(request_id)

    async def run() -> None:
        async with prefill_server(TINY, read_blocks) as prefill:
            client = KvTransferClient(TINY, "decode-0", timeout_s=0.5)
            try:
                start = time.monotonic()
                with pytest.raises(KvPullError, match="timed out"):
                    await client.pull(prefill.handle(TINY, "slow", [1]))
                assert time.monotonic() - start < 3.0
                assert client.stats().num_open_channels == 0
                stall.set()
                got = await client.pull(prefill.handle(TINY, "r2", [30, 0]))
                assert torch.equal(got, engine.expected("r2"))
                assert client.stats().num_open_channels == 1
                # The prefill side dropped the dead channel once its send failed.
                await wait_until(
                    lambda: prefill.service.stats().num_open_channels == 1,
                    timeout_s=2.0,
                    what="the prefill side to drop the dead channel",
                )
            finally:
                stall.set()
                await client.close()

    asyncio.run(run())


def test_server_stopped_during_a_pull_fails_it_without_a_hang() -> None:
    engine = make_engine()
    called, release = threading.Event(), threading.Event()

    def read_blocks(request_id: str) -> torch.Tensor | CacheBlocks:
        called.set()
        release.wait(20)
        return engine.read_blocks(request_id)

    async def run() -> None:
        async with prefill_server(TINY, read_blocks) as prefill:
            client = KvTransferClient(TINY, "decode-0", timeout_s=20.0)
            try:
                pull = asyncio.create_task(client.pull(prefill.handle(TINY, "r1", [1, 2, 3])))
                assert await asyncio.to_thread(called.wait, 10)
                start = time.monotonic()
                stop = asyncio.create_task(prefill.service.stop())
                with pytest.raises(KvPullError, match="broke"):
                    await pull
                assert time.monotonic() - start < 2.0  # the socket was shut, not timed out
                release.set()
                await stop
                assert prefill.service.stats().num_transfer_threads == 0
            finally:
                release.set()
                await client.close()

    asyncio.run(run())


@pytest.mark.parametrize("fault", ["truncated", "stalled", "garbage"])
def test_broken_payload_closes_the_channel(fault: str) -> None:
    """Wire-level faults (a peer dying mid-payload) against the decode side's channel."""
    ours, theirs = socket.socketpair()
    shape = TINY.block_shape(3)
    nbytes = TINY.block_nbytes(3)

    def fake_prefill() -> None:
        with theirs:
            assert isinstance(recv_message(theirs, 5.0), DataRequest)
            if fault == "garbage":
                theirs.sendall(b"\x00\x00\x00\x05hello")
                return
            send_message(theirs, DataReply("ok", shape=shape, dtype="float32", nbytes=nbytes))
            theirs.sendall(b"\x01" * (nbytes // 2))
            if fault == "stalled":
                theirs.recv(1)  # until the decode side gives up and closes

    thread = threading.Thread(target=fake_prefill)
    thread.start()
    ours.settimeout(0.5)
    channel = TcpChannel("c1", ours, TINY, timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(KvPullError, match="broke"):
        channel.pull("r1", 3)
    assert time.monotonic() - start < 3.0
    assert not channel.is_open
    thread.join(5)
    assert not thread.is_alive()
