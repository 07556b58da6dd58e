"""After close/stop nothing is left: no channels, no threads, no sockets."""

from __future__ import annotations

import asyncio
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
from tests.helpers.kv_transfer_harness import (
    TINY,
    FakeEngine,
    prefill_server,
    random_cache,
    socket_fds,
    thread_names,
)

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
