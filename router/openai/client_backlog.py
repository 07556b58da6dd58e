"""How many bytes written to a client's connection the client has not taken yet.

Two buffers hold them: the event loop's transport (what the kernel has not accepted)
and the kernel's send queue (what the peer has not acknowledged; Linux's SIOCOUTQ).
While a write waits on a client, nothing new goes in, so the sum falls exactly as the
client's kernel acknowledges data: each time a slow reader's receive window reopens
(every 4-5 s for one reading 20 KB/s over loopback), where the transport's buffer alone
moves only once the kernel has a third of its send buffer free again (a megabyte or
more once it has grown).
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios


def unsent_bytes(transport: asyncio.BaseTransport | None) -> int:
    """Bytes written to `transport` its peer has not taken (0 once it is closed). Where
    the kernel cannot tell (not Linux, not TCP), the transport's buffer alone."""
    if not isinstance(transport, asyncio.WriteTransport) or transport.is_closing():
        return 0
    return transport.get_write_buffer_size() + _kernel_unacknowledged(transport)


def _kernel_unacknowledged(transport: asyncio.WriteTransport) -> int:
    sock = transport.get_extra_info("socket")
    if sock is None or sock.type != socket.SOCK_STREAM:
        return 0
    try:
        queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4)  # = SIOCOUTQ
    except OSError:
        return 0
    return struct.unpack("i", queued)[0]
