"""After close/stop nothing is left: no channels, no threads, no sockets."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import warnings

import pytest

from tandem.kv_transfer import (
    KvHandle,
    KvPullError,
    KvTransferClient,
    KvTransferError,
    LocalRegistry,
)
from tandem.kv_transfer.tcp_server import TcpDataServer
from tests.helpers.kv_transfer_harness import (
    TINY,
    FakeEngine,
    bits,
    prefill_server,
    random_cache,
    socket_fds,
    thread_names,
)
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


async def scenario(engine: FakeEngine) -> None:
    """Two decode clients on one prefill server, good and failed pulls, plus a local one."""
    registry = LocalRegistry()
    registry.register("local-prefill", TINY, engine.read_blocks)
    async with prefill_server(TINY, engine.read_blocks) as prefill:
        clients = [KvTransferClient(TINY, f"decode-{i}", timeout_s=5.0) for i in range(2)]
        local = KvTransferClient(TINY, "decode-local", backend="local", local_registry=registry)
        for client in clients:
            for request_id, ids in engine.held.items():
                await client.pull(prefill.handle(TINY, request_id, ids))
            with pytest.raises(KvPullError):
                await client.pull(prefill.handle(TINY, "gone", [1]))
        await local.pull(KvHandle("local-prefill", "", "r1", [1, 2], 8, TINY.fingerprint()))
        assert prefill.service.stats().num_open_channels == 2
        assert prefill.service.stats().num_transfer_threads >= 2
        assert all(c.stats().num_transfer_threads >= 1 for c in clients)
        for client in (*clients, local):
            await client.close()
            assert client.stats().num_open_channels == 0
            assert client.stats().num_transfer_threads == 0
        await prefill.service.stop()
        stats = prefill.service.stats()
        assert (stats.num_open_channels, stats.num_transfer_threads) == (0, 0)


def test_close_and_stop_leave_nothing_behind() -> None:
    engine = FakeEngine(random_cache(TINY, 16), {"r1": [1, 2], "r2": [15, 3, 7]})
    # gRPC starts process-wide threads on first use: warm it up before the snapshot.
    asyncio.run(scenario(engine))
    gc.collect()
    threads_before, sockets_before = thread_names(), socket_fds()
    with warnings.catch_warnings(record=True) as caught:
        # A socket closed by the garbage collector instead of its owner warns.
        warnings.simplefilter("always", ResourceWarning)
        asyncio.run(scenario(engine))
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert thread_names() == threads_before
    assert socket_fds() == sockets_before


def test_closed_client_refuses_pulls() -> None:
    async def run() -> None:
        client = KvTransferClient(TINY, "decode-0")
        await client.close()
        with pytest.raises(KvTransferError, match="closed"):
            await client.pull(KvHandle("p", "127.0.0.1:1", "r", [1], 4, TINY.fingerprint()))

    asyncio.run(run())


async def cancel_one_pull_while_opening(prefill, client: KvTransferClient) -> bool:
    """Cancel a first pull as soon as the prefill side counts a channel the client does
    not; True when that moment came before the pull finished."""

    def server_channels() -> int:
        return prefill.service.stats().num_open_channels

    pull = asyncio.create_task(client.pull(prefill.handle(TINY, "r1", [1, 2])))
    await wait_until(lambda: pull.done() or server_channels() > client.stats().num_open_channels)
    in_window = not pull.done()
    pull.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await pull
    await wait_until(
        lambda: server_channels() == client.stats().num_open_channels, 5,
        "as many channels on the prefill side as on the client",
    )  # fmt: skip
    return in_window


def test_a_pull_cancelled_while_its_channel_opens_leaves_no_half_open_channel() -> None:
    """Cancelled after the prefill side opened the channel, before the client stored it:
    the prefill side once kept a channel nobody would connect to (counted open until a
    later opening, timeout_s after, dropped it). The opening now completes, for the next
    pull or for `close`."""
    engine = FakeEngine(random_cache(TINY, 16), {"r1": [1, 2]})

    async def run() -> int:
        num_in_window = 0
        async with prefill_server(TINY, engine.read_blocks) as prefill:
            for _ in range(10):  # each round a new client: a new opening
                client = KvTransferClient(TINY, "decode-0", timeout_s=5.0)
                try:
                    num_in_window += await cancel_one_pull_while_opening(prefill, client)
                    got = await client.pull(prefill.handle(TINY, "r1", [1, 2]))
                    assert bits(got).equal(bits(engine.expected("r1")))
                finally:
                    await client.close()
                await wait_until(
                    lambda: prefill.service.stats().num_open_channels == 0, 5, "none after close"
                )
        return num_in_window

    assert asyncio.run(run()) >= 1  # some cancellations hit the opening


def test_a_channel_whose_socket_never_comes_is_dropped_after_the_timeout() -> None:
    """The decode side died between OpenChannel and connecting: the prefill worker's count
    (its Stats, the idle checks) drops the channel once `timeout_s` passed, without
    waiting for another channel to be opened."""

    async def run() -> None:
        server = TcpDataServer(TINY, FakeEngine(random_cache(TINY, 4), {}).read_blocks,
                               "127.0.0.1", timeout_s=0.2)  # fmt: skip
        try:
            server.open_channel("never-connected")
            assert server.num_channels == 1
            await wait_until(lambda: server.num_channels == 0, 5, "the channel dropped")
        finally:
            await server.stop()

    asyncio.run(run())


def test_channels_to_prefill_workers_gone_for_good_are_closed_once_idle() -> None:
    """A decode worker kept a channel (a socket in CLOSE-WAIT) to every prefill worker it
    ever pulled from: each replaced or removed one left one more. An idle channel is
    closed at both ends; a live worker's next pull opens a new one."""
    engine = FakeEngine(random_cache(TINY, 16), {"r1": [1, 2]})

    async def run() -> None:
        client = KvTransferClient(TINY, "decode-0", timeout_s=5.0, idle_close_s=0.4)
        try:
            async with prefill_server(TINY, engine.read_blocks) as live:
                async with prefill_server(TINY, engine.read_blocks) as going:
                    going.worker_id = "prefill-gone"
                    for prefill in (live, going):
                        await client.pull(prefill.handle(TINY, "r1", [1, 2]))
                    assert client.stats().num_open_channels == 2
                # `going` stopped: nothing will pull from it again.
                await wait_until(lambda: client.stats().num_open_channels == 0, 10, "closed")
                await wait_until(lambda: live.service.stats().num_open_channels == 0, 10,
                                 "closed at the prefill end too")  # fmt: skip
                got = await client.pull(live.handle(TINY, "r1", [1, 2]))
                assert bits(got).equal(bits(engine.expected("r1")))
                assert client.stats().num_open_channels == 1
        finally:
            await client.close()

    asyncio.run(run())
