"""The bytes a real TCP client has not taken yet: what sits in the server's transport
and in its kernel's send queue, falling as the client reads, whatever its pace."""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios

import pytest

from tandem.router.openai.client_backlog import unsent_bytes

pytestmark = pytest.mark.timeout(30)

TOTAL = 8 << 20  # more than the loopback connection's buffers hold


def bytes_waiting_to_be_read(sock: socket.socket) -> int:
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]


def test_unsent_bytes_fall_exactly_as_the_client_reads():
    async def scenario() -> list[tuple[int, int]]:
        accepted: asyncio.Future[asyncio.StreamWriter] = asyncio.Future()

        async def on_client(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set_result(writer)

        server = await asyncio.start_server(on_client, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port), timeout=10)
        server_side = await asyncio.wait_for(accepted, 10)
        server_side.write(b"x" * TOTAL)  # the client reads nothing yet
        ledger = []  # (unsent, what the client read or its kernel holds for it)
        num_read = 0
        try:
            for _ in range(4):
                await asyncio.sleep(0.3)  # let the loopback settle
                received = num_read + bytes_waiting_to_be_read(client)
                ledger.append((unsent_bytes(server_side.transport), received))
                num_read += len(await asyncio.to_thread(client.recv, 256 << 10))
        finally:
            client.close()
            server_side.close()
            server.close()
            await server.wait_closed()
        return ledger

    ledger = asyncio.run(scenario())
    # Every byte written is either still unsent or with the client: nothing is lost to
    # the count (a transport-only count would leave out the kernel's send queue).
    assert [unsent + received for unsent, received in ledger] == [TOTAL] * len(ledger)
    unsent = [u for u, _ in ledger]
    assert unsent[0] > 0
    assert unsent == sorted(unsent, reverse=True) and unsent[-1] < unsent[0]


def test_a_closed_connection_has_nothing_unsent():
    assert unsent_bytes(None) == 0
