"""The TCP data plane's framing and vectored I/O, over a socketpair."""

from __future__ import annotations

import random
import socket
import threading

import pytest

from tandem.kv_transfer.wire import (
    DataReply,
    DataRequest,
    Hello,
    ProtocolError,
    recv_buffers,
    recv_message,
    send_buffers,
    send_message,
)

pytestmark = pytest.mark.timeout(30)


def test_headers_round_trip() -> None:
    a, b = socket.socketpair()
    with a, b:
        for msg in (
            Hello("c1"),
            DataRequest("r1"),
            DataReply("ok", shape=(2, 2, 3, 4, 1, 8), dtype="bfloat16", nbytes=1536),
            DataReply("not_found", "no KV held"),
        ):
            send_message(a, msg)
            assert recv_message(b, 1.0) == msg
        a.sendall(b"\x00\x00\x00\x02{}")
        with pytest.raises(ProtocolError):
            recv_message(b, 1.0)
        a.sendall(b"\xff\xff\xff\xff")
        with pytest.raises(ProtocolError, match="exceeds"):
            recv_message(b, 1.0)


def test_vectored_send_and_receive_survive_partial_transfers() -> None:
    rng = random.Random(0)
    # More buffers than one sendmsg takes, and more bytes than the socket buffers hold.
    sizes = [rng.choice([0, 1, 7, 4096, 65536]) for _ in range(3000)]
    payload = rng.randbytes(sum(sizes))
    sources, offset = [], 0
    for size in sizes:
        sources.append(memoryview(payload)[offset : offset + size])
        offset += size
    rng.shuffle(sizes)  # receive into differently split buffers
    received = bytearray(sum(sizes))
    view, sinks, offset = memoryview(received), [], 0
    for size in sizes:
        sinks.append(view[offset : offset + size])
        offset += size
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5.0)
        b.settimeout(5.0)
        sender = threading.Thread(target=send_buffers, args=(a, sources))
        sender.start()
        assert recv_buffers(b, sinks) == len(payload)
        sender.join(5)
    assert bytes(received) == payload


def test_vectored_receive_reports_a_closed_peer() -> None:
    a, b = socket.socketpair()
    with b:
        a.sendall(b"abc")
        a.close()
        with pytest.raises(ConnectionError, match="after 3 bytes"):
            recv_buffers(b, [memoryview(bytearray(2)), memoryview(bytearray(5))])
