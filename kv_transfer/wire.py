"""Framing of the TCP data plane: small JSON headers, then raw tensor bytes.

Every header is `!I` length + UTF-8 JSON with a "type". A channel's socket carries:
decode → prefill `Hello` once (channel id + proof of the cluster token; the prefill side
answers `DataReply("ok")`, or "unauthenticated" and closes before any KV is read), then
per pull `DataRequest`; prefill → decode `DataReply` (status, shape, dtype, nbytes or an
error message) and, when ok, exactly `nbytes` bytes of the contiguous
[layers, 2, blocks, block_size, heads, dim] tensor.
No pickle, no per-block round trips.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch

_LEN = struct.Struct("!I")
MAX_HEADER_BYTES = 1 << 16
# sendall per slice, so a socket timeout bounds a stall, not a whole large payload.
SEND_SLICE_BYTES = 8 << 20


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, sharing its memory: sockets read and write
    tensors in place (as uint8, since numpy has no bfloat16)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data


class ProtocolError(ConnectionError):
    """The peer sent something that is not this protocol."""


class PeerClosed(ConnectionError):
    """The peer closed the connection between messages (a normal end of a channel)."""


@dataclass(frozen=True)
class Hello:
    """First message on a new data socket: binds it to an opened channel."""

    channel_id: str
    # `ClusterAuth.kv_hello_proof(channel_id)` ("" when the cluster has no token).
    proof: str = field(default="", repr=False)


@dataclass(frozen=True)
class DataRequest:
    request_id: str


@dataclass(frozen=True)
class DataReply:
    # "ok" (payload follows), "not_found" (no KV held: expired, released, unknown),
    # "unauthenticated" (a Hello without a valid token proof; the socket closes) or
    # "error" (the channel or the read failed; see message).
    status: str
    message: str = ""
    shape: tuple[int, ...] = ()
    dtype: str = ""
    nbytes: int = 0


_MESSAGES = {cls.__name__: cls for cls in (Hello, DataRequest, DataReply)}
Message = Hello | DataRequest | DataReply


def send_message(sock: socket.socket, msg: Message) -> None:
    body = json.dumps({"type": type(msg).__name__, **asdict(msg)}).encode()
    if len(body) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(body)} bytes exceeds {MAX_HEADER_BYTES}")
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_message(sock: socket.socket, timeout_s: float, *, wait_idle: bool = False) -> Message:
    """Read one header; with `wait_idle`, wait without a timeout for its first byte."""
    prefix = bytearray(_LEN.size)
    view = memoryview(prefix)
    got = 0
    if wait_idle:
        sock.settimeout(None)
        try:
            got = sock.recv_into(view)
        finally:
            sock.settimeout(timeout_s)
        if got == 0:
            raise PeerClosed("peer closed the channel")
    recv_exact(sock, view[got:])
    (size,) = _LEN.unpack(prefix)
    if size > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {size} bytes exceeds {MAX_HEADER_BYTES}")
    body = bytearray(size)
    recv_exact(sock, memoryview(body))
    try:
        raw = json.loads(body)
        cls = _MESSAGES[raw.pop("type")]
        if cls is DataReply:
            raw["shape"] = tuple(raw.get("shape", ()))
        return cls(**raw)
    except (ValueError, KeyError, TypeError) as e:
        raise ProtocolError(f"malformed header: {e}") from e


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket (each recv bounded by the socket's timeout)."""
    offset, size = 0, len(view)
    while offset < size:
        got = sock.recv_into(view[offset:])
        if got == 0:
            raise ConnectionError(f"peer closed after {offset} of {size} bytes")
        offset += got


def _check_deadline(deadline: float, sent: int) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"send cut off at its deadline after {sent} bytes")


def send_payload(
    sock: socket.socket, chunks: Iterable[memoryview], deadline: float = math.inf
) -> int:
    """Send chunk after chunk (each may be reused once sent); returns the bytes sent.
    TimeoutError once `deadline` (monotonic s) passes between slices."""
    sent = 0
    for chunk in chunks:
        for start in range(0, len(chunk), SEND_SLICE_BYTES):
            piece = chunk[start : start + SEND_SLICE_BYTES]
            _check_deadline(deadline, sent)
            sock.sendall(piece)
            sent += len(piece)
    return sent
