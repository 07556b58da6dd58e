"""Zero-copy pins: a transfer calls `CacheBlocks.on_done` exactly once, when it stops
touching the blocks, on both sides and however the pull ends (sent, cancelled, puller
killed or stalled)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import grpc
import pytest

from tandem.kv_transfer import CacheBlocks, KvLayout, KvPullError, KvTransferClient, LocalRegistry
from tandem.proto.tandem.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.helpers.kv_transfer_harness import SMALL, TINY, bits, prefill_server, random_cache
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


class Pins:
    """Counts `on_done` calls per request and the threads that made them."""

    def __init__(self) -> None:
        self.done: dict[str, int] = {}
        self.threads: list[str] = []
        self._lock = threading.Lock()

    def release(self, key: str) -> None:
        with self._lock:
            self.done[key] = self.done.get(key, 0) + 1
            self.threads.append(threading.current_thread().name)

    def blocks(self, cache, key: str, block_ids: list[int]) -> CacheBlocks:
        return CacheBlocks(cache, block_ids, on_done=lambda: self.release(key))


@pytest.mark.parametrize("backend", ["tcp", "local"])
def test_both_sides_release_their_blocks_once_after_a_pull(backend: str) -> None:
    source, dest, pins = random_cache(TINY, 16, seed=1), random_cache(TINY, 16, seed=2), Pins()

    def read_blocks(request_id: str) -> CacheBlocks:
        return pins.blocks(source, "source", [5, 1, 2])

    async def run() -> None:
        async with prefill_server(TINY, read_blocks) as prefill:
            registry = LocalRegistry()
            registry.register(prefill.worker_id, TINY, read_blocks)
            client = KvTransferClient(TINY, "decode-0", backend, local_registry=registry)
            try:
                handle = prefill.handle(TINY, "r1", [5, 1, 2])
                await client.pull(handle, out=pins.blocks(dest, "dest", [9, 10, 0]))
                assert pins.done == {"source": 1, "dest": 1}
                assert bits(dest[:, :, [9, 10, 0]]).equal(bits(source[:, :, [5, 1, 2]]))
                # A pull refused before any transfer still releases its destination.
                with pytest.raises(ValueError):
                    await client.pull(handle, out=pins.blocks(dest, "bad", [1]))
                assert pins.done["bad"] == 1
            finally:
                await client.close()

    asyncio.run(run())


def test_cancelled_pull_releases_its_destination_when_its_thread_stops() -> None:
    source, dest, pins = random_cache(TINY, 8, seed=1), random_cache(TINY, 8, seed=2), Pins()
    stall = threading.Event()

    def read_blocks(request_id: str) -> CacheBlocks:
        stall.wait(20)  # the pull's thread now waits for the reply
        return pins.blocks(source, "source", [1, 2])

    async def run() -> None:
        async with prefill_server(TINY, read_blocks) as prefill:
            client = KvTransferClient(TINY, "decode-0")
            try:
                pull = asyncio.create_task(
                    client.pull(
                        prefill.handle(TINY, "r1", [1, 2]), out=pins.blocks(dest, "d", [3, 4])
                    )
                )
                await asyncio.sleep(0.2)
                pull.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await pull
                await wait_until(lambda: pins.done.get("d") == 1, 10, "destination unpinned")
                # Released by the writer thread itself once it failed, not by the canceller.
                assert pins.threads[-1].startswith("kv-client-")
                stall.set()
                await wait_until(lambda: pins.done.get("source") == 1, 10, "source unpinned")
                assert pins.done == {"d": 1, "source": 1}
            finally:
                stall.set()
                await client.close()

    asyncio.run(run())


# A puller that reads the start of a payload, then stops reading (or is killed).
_PULLER = """
import socket, sys
from tandem.kv_transfer.wire import DataRequest, Hello, recv_exact, recv_message, send_message
host, port, channel_id = sys.argv[1], int(sys.argv[2]), sys.argv[3]
sock = socket.create_connection((host, port), timeout=30)
send_message(sock, Hello(channel_id))
assert recv_message(sock, 30).status == "ok"
send_message(sock, DataRequest("r1"))
reply = recv_message(sock, 30)
recv_exact(sock, memoryview(bytearray(1 << 20)))
print("reading", reply.nbytes, flush=True)
sys.stdin.read()  # never reads the socket again
"""


@pytest.mark.parametrize("fault", ["killed", "stalled"])
def test_puller_that_dies_or_stalls_mid_pull_releases_the_source(fault: str) -> None:
    # 25 MiB: far more than the sockets' buffers hold, so the send is mid-way.
    layout: KvLayout = SMALL
    source, pins = random_cache(layout, 64, seed=3), Pins()

    def read_blocks(request_id: str) -> CacheBlocks:
        return pins.blocks(source, "source", list(range(64)))

    async def run() -> None:
        async with prefill_server(layout, read_blocks, timeout_s=1.0) as prefill:
            async with grpc.aio.insecure_channel(prefill.endpoint) as channel:
                opened = await worker_pb2_grpc.KvTransferStub(channel).OpenChannel(
                    worker_pb2.OpenChannelRequest(
                        decode_worker_id="puller",
                        layout_fingerprint=layout.fingerprint(),
                        backend=worker_pb2.KV_BACKEND_TCP,
                    ),
                    timeout=10,
                )
            host, port = opened.tcp_endpoint.rsplit(":", 1)
            puller = subprocess.Popen(
                [sys.executable, "-c", _PULLER, host, port, opened.channel_id],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                line = await asyncio.wait_for(asyncio.to_thread(puller.stdout.readline), 30)
                assert line.startswith("reading") and int(line.split()[1]) == 64 * (
                    layout.block_nbytes(1)
                )
                assert pins.done == {}  # mid-send: still pinned
                if fault == "killed":
                    puller.kill()
                # Stalled: the send's socket timeout (1 s) cuts it off.
                await wait_until(lambda: pins.done.get("source") == 1, 15, "source unpinned")
                await wait_until(lambda: prefill.service.stats().num_transfer_threads == 0, 15)
            finally:
                puller.kill()
                puller.communicate(timeout=10)
            assert pins.done == {"source": 1}

    asyncio.run(run())


def test_pull_of_released_kv_pins_nothing() -> None:
    dest, pins = random_cache(TINY, 4), Pins()

    def read_blocks(request_id: str) -> CacheBlocks:
        raise KeyError(request_id)

    async def run() -> None:
        async with prefill_server(TINY, read_blocks) as prefill:
            client = KvTransferClient(TINY, "decode-0")
            try:
                with pytest.raises(KvPullError, match="no KV held"):
                    await client.pull(
                        prefill.handle(TINY, "r1", [1]), out=pins.blocks(dest, "d", [2])
                    )
                assert pins.done == {"d": 1}
            finally:
                await client.close()

    asyncio.run(run())
