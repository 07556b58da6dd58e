"""Prefill side of the TCP data plane: a listening socket owned by `KvTransferService`.

`OpenChannel` registers a channel id; the decode side then connects and names it in a
`Hello` that proves the cluster token (else the socket is refused and closed before
anything else is read or sent), and that one socket serves every pull of the channel,
each in turn, from a thread of its own (blocking sends release the GIL). Accepting runs
on the event loop.
Threads and sockets end on EOF, on `close_channel`, or on `stop()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable

from tandem.kv_transfer.blocks import PayloadReader, ReadBlocks, finished_with
from tandem.kv_transfer.layout import KvLayout
from tandem.kv_transfer.wire import (
    DataReply,
    DataRequest,
    Hello,
    PeerClosed,
    ProtocolError,
    recv_message,
    send_message,
)
from tandem.proto.cluster_auth import ClusterAuth, RefusalLog

logger = logging.getLogger(__name__)


# Keepalive probing of idle channels: a vanished peer is noticed in about a minute.
_KEEPALIVE = {"TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3}


def tune_socket(sock: socket.socket, timeout_s: float | None) -> None:
    """Blocking with a timeout, no Nagle delay on headers, keepalive for idle channels."""
    sock.settimeout(timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE.items():
        if hasattr(socket, name):  # Linux names; other platforms keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def format_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class TcpDataServer:
    """Data sockets of the TCP channels of one prefill worker."""

    def __init__(
        self,
        layout: KvLayout,
        read_blocks: ReadBlocks,
        host: str,
        timeout_s: float,
        advertise_host: str | None = None,
        auth: ClusterAuth | None = None,
        on_refused: Callable[[], None] | None = None,
    ) -> None:
        self.layout = layout
        # Checks each connection's Hello; open (no token) by default.
        self.auth = auth or ClusterAuth()
        self.refusals = RefusalLog("KV data connection", on_refused=on_refused)
        self.read_blocks = read_blocks
        self.host = host
        self.advertise_host = advertise_host or host
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        # Opened channels waiting for their socket -> time opened (monotonic s).
        self._pending: dict[str, float] = {}
        self._attached: dict[str, socket.socket] = {}
        # Every accepted socket still open (attached or still in its Hello).
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._stopped = False
        self.endpoint = ""

    # ----- lifecycle (event loop) ----------------------------------------------

    def start(self) -> str:
        """Bind the listening socket (idempotent); returns the advertised host:port."""
        if self._stopped:
            raise RuntimeError("TCP data server already stopped")
        if self._listener is None:
            self._listener = socket.create_server((self.host, 0), backlog=64)
            self._listener.setblocking(False)
            port = self._listener.getsockname()[1]
            self.endpoint = format_endpoint(self.advertise_host, port)
            logger.info("KV data server listening on %s", self.endpoint)
        with contextlib.suppress(RuntimeError):  # no running loop: accept on first open
            self._ensure_accepting()
        return self.endpoint

    def _ensure_accepting(self) -> None:
        if self._accept_task is None or self._accept_task.done():
            loop = asyncio.get_running_loop()
            self._accept_task = loop.create_task(self._accept_loop(self._listener))

    async def stop(self) -> None:
        """Close the listener and every socket; wait (bounded) for the threads to end."""
        self._stopped = True
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept_task
            self._accept_task = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            self._pending.clear()
            self._attached.clear()
            for conn in self._conns:
                _shutdown(conn)
        deadline = time.monotonic() + self.timeout_s
        while self.num_threads and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        if self.num_threads:
            logger.warning("%d KV transfer threads still busy after stop", self.num_threads)

    # ----- channels (event loop) -----------------------------------------------

    def open_channel(self, channel_id: str) -> str:
        """Expect a socket for `channel_id`; returns the endpoint to connect to."""
        endpoint = self.start()
        self._ensure_accepting()
        with self._lock:
            self._drop_unconnected()
            self._pending[channel_id] = time.monotonic()
        return endpoint

    def close_channel(self, channel_id: str) -> bool:
        """Forget a channel and end its socket; False if unknown."""
        with self._lock:
            pending = self._pending.pop(channel_id, None) is not None
            conn = self._attached.pop(channel_id, None)
            if conn is not None:
                _shutdown(conn)
        return pending or conn is not None

    @property
    def num_channels(self) -> int:
        with self._lock:
            self._drop_unconnected()
            return len(self._pending) + len(self._attached)

    def _drop_unconnected(self) -> None:
        """Forget channels opened more than `timeout_s` ago whose socket never came (the
        decode side died or gave up in between). Called with the lock held: by the next
        opening, and by every count, so a worker with no further pulls still reads idle."""
        now = time.monotonic()
        for cid in [c for c, t in self._pending.items() if now - t > self.timeout_s]:
            logger.warning("KV channel %s was opened but never connected; dropping", cid)
            del self._pending[cid]

    @property
    def num_threads(self) -> int:
        with self._lock:
            return sum(t.is_alive() for t in self._threads)

    async def _accept_loop(self, listener: socket.socket | None) -> None:
        loop = asyncio.get_running_loop()
        while listener is not None:
            try:
                conn, addr = await loop.sock_accept(listener)
            except OSError as e:
                logger.warning("KV data server accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            tune_socket(conn, self.timeout_s)
            thread = threading.Thread(
                target=self._serve,
                args=(conn, format_endpoint(addr[0], addr[1])),
                name=f"kv-tcp-serve-{addr[1]}",
                daemon=True,
            )
            with self._lock:
                if self._stopped:
                    conn.close()
                    return
                self._conns.add(conn)
                self._threads.add(thread)
            thread.start()

    # ----- one connection (its own thread) -------------------------------------

    def _serve(self, conn: socket.socket, peer: str) -> None:
        channel_id = ""
        try:
            hello = recv_message(conn, self.timeout_s)
            if not isinstance(hello, Hello):
                self.refusals.refused("", peer, f"expected a Hello, got a {type(hello).__name__}")
                status = "unauthenticated" if self.auth.requires_token else "error"
                send_message(conn, DataReply(status, "expected a Hello"))
                return
            if not self.auth.accepts_kv_hello(hello.channel_id, hello.proof):
                reason = "no cluster token proof" if not hello.proof else "wrong cluster token"
                self.refusals.refused("", peer, reason)
                send_message(conn, DataReply("unauthenticated", f"{reason}: KV data "
                                             "connections need the cluster token"))  # fmt: skip
                return
            if not self._attach(hello.channel_id, conn):
                send_message(conn, DataReply("error", f"unknown KV channel {hello.channel_id!r}"))
                return
            channel_id = hello.channel_id
            send_message(conn, DataReply("ok"))
            reader = PayloadReader(self.layout)
            while True:
                request = recv_message(conn, self.timeout_s, wait_idle=True)
                if not isinstance(request, DataRequest):
                    raise ProtocolError(f"expected a DataRequest, got {request}")
                self._serve_pull(conn, reader, request.request_id)
        except PeerClosed:
            logger.debug("KV channel %s closed by the decode side", channel_id)
        except (OSError, ProtocolError) as e:
            if not self._stopped:
                logger.warning("KV channel %s broke: %s", channel_id or "(unbound)", e)
        except Exception:
            if not self._stopped:
                logger.exception("KV channel %s failed", channel_id or "(unbound)")
        finally:
            with self._lock:
                if self._attached.get(channel_id) is conn:
                    del self._attached[channel_id]
                self._conns.discard(conn)
                conn.close()
                self._threads.discard(threading.current_thread())

    def _attach(self, channel_id: str, conn: socket.socket) -> bool:
        with self._lock:
            if self._pending.pop(channel_id, None) is None:
                return False
            self._attached[channel_id] = conn
            return True

    def _serve_pull(self, conn: socket.socket, reader: PayloadReader, request_id: str) -> None:
        """Reply and send one pull. Blocks read in place are released (unpinned) when
        the send ends, however it ends; a send is cut off (socket closed) after
        `timeout_s`, so a stalled puller cannot pin blocks for longer."""
        try:
            result = self.read_blocks(request_id)
        except KeyError:
            message = f"no KV held for request {request_id!r} (expired, released or unknown)"
            send_message(conn, DataReply("not_found", message))
            return
        except Exception as e:
            logger.exception("read_blocks(%r) failed", request_id)
            send_message(conn, DataReply("error", f"reading the KV of {request_id!r} failed: {e}"))
            return
        try:
            try:
                reply, send = reader.prepare(result)
            except ValueError as e:
                logger.error("read_blocks(%r) returned unusable KV: %s", request_id, e)
                reply, send = DataReply("error", str(e)), _send_nothing
            send_message(conn, reply)
            sent = send(conn, time.monotonic() + self.timeout_s)
            if sent != reply.nbytes:
                raise ProtocolError(f"sent {sent} bytes, announced {reply.nbytes}")
        finally:
            finished_with(result)


def _send_nothing(sock: socket.socket, deadline: float) -> int:
    return 0


def _shutdown(conn: socket.socket) -> None:
    # Wakes the thread blocked on this socket; that thread closes it.
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
