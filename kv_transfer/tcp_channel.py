"""Decode side of a TCP channel: one socket to a prefill worker's data server.

Opened once per (decode worker, prefill worker) pair and reused for every pull; pulls
on it are serialised by the client. Each pull is one request header, one reply header
and the raw payload received straight into the result tensor. Any socket failure
closes the channel (the client drops it and the next pull reconnects).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading

import torch

from tandem.kv_transfer.blocks import CacheBlocks, block_iovecs
from tandem.kv_transfer.buffers import BufferPool
from tandem.kv_transfer.errors import KvPullError
from tandem.kv_transfer.layout import KvLayout
from tandem.kv_transfer.tcp_server import tune_socket
from tandem.kv_transfer.wire import (
    DataReply,
    DataRequest,
    Hello,
    ProtocolError,
    byte_view,
    recv_exact,
    recv_message,
    send_message,
)
from tandem.proto.cluster_auth import ClusterAuth

logger = logging.getLogger(__name__)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"endpoint must be host:port, got {endpoint!r}")
    return host.strip("[]"), int(port)


class TcpChannel:
    """Blocking; call from a transfer thread. Thread-safe (one pull at a time)."""

    def __init__(
        self,
        channel_id: str,
        sock: socket.socket,
        layout: KvLayout,
        timeout_s: float,
        buffers: BufferPool | None = None,
    ) -> None:
        self.channel_id = channel_id
        self.layout = layout
        self.timeout_s = timeout_s
        # Where results without `out` are received (recycled memory: no page faults).
        self.buffers = buffers or BufferPool(0)
        self._sock: socket.socket | None = sock
        # Held for each pull and for closing the socket, so a fd is never closed in use.
        self._io_lock = threading.Lock()

    @classmethod
    def connect(
        cls,
        channel_id: str,
        endpoint: str,
        layout: KvLayout,
        timeout_s: float,
        buffers: BufferPool | None = None,
        auth: ClusterAuth | None = None,
    ) -> TcpChannel:
        """Connect and bind the socket to the opened channel, proving the cluster token
        of `auth`; KvPullError on failure (a refused proof included)."""
        try:
            sock = socket.create_connection(split_endpoint(endpoint), timeout=timeout_s)
        except OSError as e:
            raise KvPullError(f"cannot connect to KV data server {endpoint}: {e}") from e
        try:
            tune_socket(sock, timeout_s)
            proof = auth.kv_hello_proof(channel_id) if auth is not None else ""
            send_message(sock, Hello(channel_id, proof))
            ack = recv_message(sock, timeout_s)
            if not isinstance(ack, DataReply) or ack.status != "ok":
                raise ProtocolError(f"channel refused: {ack}")
        except (OSError, ProtocolError) as e:
            sock.close()
            raise KvPullError(f"KV data server {endpoint} refused channel: {e}") from e
        return cls(channel_id, sock, layout, timeout_s, buffers)

    @property
    def is_open(self) -> bool:
        return self._sock is not None

    def pull(
        self, request_id: str, num_blocks: int, out: torch.Tensor | CacheBlocks | None = None
    ) -> torch.Tensor:
        """The request's blocks (received into `out` when given: a tensor, or blocks of a
        contiguous CPU cache, then the cache is returned); KvPullError when they are gone
        or the channel broke."""
        expected = self.layout.block_shape(num_blocks)
        with self._io_lock:
            sock = self._sock
            if sock is None:
                raise KvPullError(f"KV channel {self.channel_id} is closed")
            try:
                send_message(sock, DataRequest(request_id))
                reply = recv_message(sock, self.timeout_s)
                if not isinstance(reply, DataReply):
                    raise ProtocolError(f"expected a DataReply, got {reply}")
                if reply.status != "ok":
                    # Nothing follows the header: the channel stays usable.
                    raise KvPullError(f"pull of {request_id!r} failed: {reply.message}")
                self._check_reply(reply)
                fits = reply.shape == expected
                if not fits or out is None:  # (a mismatch is drained, then raised)
                    out = self.buffers.empty(reply.shape, self.layout.torch_dtype)
                if isinstance(out, CacheBlocks):
                    block_iovecs(out).recv(sock)
                else:
                    recv_exact(sock, byte_view(out))
            except (OSError, ProtocolError) as e:
                self._close_locked()
                raise KvPullError(
                    f"KV channel {self.channel_id} broke while pulling {request_id!r}: "
                    f"{e or type(e).__name__}"
                ) from e
        if not fits:
            raise KvPullError(
                f"pull of {request_id!r} returned {reply.shape[2]} blocks, handle names "
                f"{num_blocks}"
            )
        return out.kv_cache if isinstance(out, CacheBlocks) else out

    def _check_reply(self, reply: DataReply) -> None:
        layout = self.layout
        shape = reply.shape
        if (
            len(shape) != 6
            or not all(isinstance(d, int) for d in (*shape, reply.nbytes))
            or shape != layout.block_shape(shape[2])
            or reply.dtype != layout.dtype
            or reply.nbytes != layout.block_nbytes(shape[2])
        ):
            raise ProtocolError(f"reply {reply} does not fit layout {layout.fingerprint()}")

    def abort(self) -> None:
        """Wake a pull blocked on the socket (it then fails and closes the channel)."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self, wait_s: float = 1.0) -> None:
        self.abort()
        if self._io_lock.acquire(timeout=wait_s):
            try:
                self._close_locked()
            finally:
                self._io_lock.release()
        else:
            logger.warning(
                "KV channel %s: a pull still runs; it will close the socket", self.channel_id
            )

    def _close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
