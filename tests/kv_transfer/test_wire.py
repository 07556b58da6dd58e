"""The TCP data plane's framing and vectored I/O, over a socketpair."""

from __future__ import annotations

import random
import socket
import threading
import time

import numpy as np
import pytest
import torch

from tandem.kv_transfer.iovec import IOV_MAX, Iovecs
from tandem.kv_transfer.wire import (
    DataReply,
    DataRequest,
    Hello,
    ProtocolError,
    recv_message,
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


def _ranges(memory: torch.Tensor, sizes: list[int], order: list[int]) -> Iovecs:
    """`sizes` consecutive ranges of `memory`, listed in `order`."""
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    return Iovecs(memory, starts[order], np.asarray(sizes)[order])


def test_vectored_send_and_receive_survive_partial_transfers() -> None:
    rng = random.Random(0)
    # More ranges than one call takes, more bytes than the socket buffers hold, ranges
    # in scattered order on both sides, split differently on each.
    sizes = [rng.choice([0, 1, 7, 4096, 65536]) for _ in range(3 * IOV_MAX)]
    source = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8)
    send_order = list(range(len(sizes)))
    rng.shuffle(send_order)
    sources = _ranges(source, sizes, send_order)
    payload = torch.cat([source[s : s + n] for s, n in _spans(sizes, send_order)])
    recv_sizes = sizes[:]
    rng.shuffle(recv_sizes)
    received = torch.zeros(sum(sizes), dtype=torch.uint8)
    recv_order = list(range(len(sizes)))
    rng.shuffle(recv_order)
    sinks = _ranges(received, recv_sizes, recv_order)
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5.0)
        b.settimeout(5.0)
        sender = threading.Thread(target=sources.send, args=(a,))
        sender.start()
        assert sinks.recv(b) == sources.nbytes == len(payload)
        sender.join(5)
    got = torch.cat([received[s : s + n] for s, n in _spans(recv_sizes, recv_order)])
    assert torch.equal(got, payload)


def _spans(sizes: list[int], order: list[int]) -> list[tuple[int, int]]:
    starts = [0, *np.cumsum(sizes)[:-1].tolist()]
    return [(starts[i], sizes[i]) for i in order]


def test_vectored_receive_reports_a_closed_peer_and_a_timeout() -> None:
    a, b = socket.socketpair()
    with b:
        b.settimeout(0.2)
        sink = Iovecs(torch.zeros(7, dtype=torch.uint8), np.array([0, 2]), np.array([2, 5]))
        with pytest.raises(TimeoutError, match="after 0 bytes"):
            sink.recv(b)
        a.sendall(b"abc")
        a.close()
        with pytest.raises(ConnectionError, match="after 3 bytes"):
            sink.recv(b)


def test_vectored_send_stops_at_its_deadline() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5.0)
        # Nobody reads: the socket fills up, then the deadline cuts the send off.
        big = Iovecs(torch.zeros(64 << 20, dtype=torch.uint8), np.array([0]), np.array([64 << 20]))
        with pytest.raises(TimeoutError, match="after"):
            big.send(a, time.monotonic() + 0.2)


def test_iovecs_refuse_ranges_outside_their_tensor() -> None:
    memory = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="outside"):
        Iovecs(memory, np.array([8]), np.array([9]))
    with pytest.raises(ValueError, match="outside"):
        Iovecs(memory, np.array([-1]), np.array([1]))
    with pytest.raises(ValueError, match="contiguous"):
        Iovecs(torch.zeros(4, 4)[:, 0], np.array([0]), np.array([1]))
