"""Vectored socket I/O over a prebuilt C iovec array (zero-copy KV payloads).

A payload sent from (or received into) a paged cache is many byte ranges: one per run
of adjacent blocks per (layer, K/V), so up to tens of thousands of 16 KiB ranges for a
32k-token prompt with scattered blocks. `socket.sendmsg`/`recvmsg_into` take a Python
list of buffers and acquire every one of them on every call, which measured costs as
much CPU as the kernel's copy. Here the ranges are built once, vectorised, as an
`iovec` array (address, length) and handed to `writev`/`readv` (libc, through ctypes,
which releases the GIL) about `OFFER_BYTES` (at most IOV_MAX ranges) at a time; per
call Python does O(log n) work (binary searches over the ranges' ends).

Memory safety: an `Iovecs` keeps a reference to the tensor its ranges point into and
checks every range lies inside it; the caller keeps the memory from being reused while
the I/O runs (the KV pins, see `engine.kv_pins`). `writev` on a socket whose peer is
gone gets EPIPE, not a signal, because Python ignores SIGPIPE (as `socket.sendmsg`
also relies on).
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import math
import os
import select
import socket
import time
from collections.abc import Callable

import numpy as np
import torch

_libc = ctypes.CDLL(None, use_errno=True)
_IoFn = Callable[[int, int, int], int]


def _bind(name: str) -> _IoFn:
    fn = getattr(_libc, name)
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_ssize_t
    return fn


_writev, _readv = _bind("writev"), _bind("readv")
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
_IOVEC_BYTES = 16  # struct iovec: void *iov_base; size_t iov_len
# Ranges offered per call: about what a socket buffer moves at once. The kernel copies
# in and checks every range offered, so offering IOV_MAX 16 KiB ranges when a call
# moves a few MiB measured ~25% more sender CPU at 1k tokens than offering 4 MiB.
OFFER_BYTES = 4 << 20


class Iovecs:
    """Byte ranges of one CPU tensor's memory, in payload order, as a C iovec array."""

    def __init__(self, memory: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray) -> None:
        """`offsets`/`lengths`: int64 byte ranges inside `memory` (contiguous, CPU);
        empty ranges are dropped. ValueError when a range lies outside it."""
        if memory.device.type != "cpu" or not memory.is_contiguous():
            raise ValueError("iovecs need a contiguous CPU tensor")
        offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if offsets.shape != lengths.shape:
            raise ValueError(f"{offsets.size} offsets but {lengths.size} lengths")
        keep = lengths != 0
        offsets, lengths = offsets[keep], lengths[keep]
        size = memory.numel() * memory.element_size()
        if offsets.size and (
            (lengths < 0).any() or (offsets < 0).any() or (offsets + lengths > size).any()
        ):
            raise ValueError(f"byte ranges outside the tensor's {size} bytes")
        self.memory = memory  # keeps the ranges' memory alive
        self.nbytes = int(lengths.sum())
        # Payload offset where each range ends (a list: bisect per call is cheapest).
        self._ends: list[int] = np.cumsum(lengths).tolist()
        self._array = np.empty((offsets.size, 2), dtype=np.uint64)
        self._array[:, 0] = offsets.astype(np.uint64) + np.uint64(memory.data_ptr())
        self._array[:, 1] = lengths.astype(np.uint64)

    def __len__(self) -> int:
        return len(self._array)

    def send(self, sock: socket.socket, deadline: float = math.inf) -> int:
        """Send every range (`writev`); the bytes sent. TimeoutError once `deadline`
        (monotonic s) passes, or the socket's timeout while the socket stays full."""
        return self._transfer(sock, _writev, select.POLLOUT, deadline)

    def recv(self, sock: socket.socket) -> int:
        """Fill every range from the socket (`readv`); the bytes received.
        ConnectionError when the peer closes first; TimeoutError when nothing arrives
        within the socket's timeout."""
        return self._transfer(sock, _readv, select.POLLIN, math.inf)

    def _transfer(self, sock: socket.socket, call: _IoFn, event: int, deadline: float) -> int:
        """Calls `call` until every range is done. A range the kernel stopped inside is
        trimmed in a copy of the array (an `Iovecs` can be used more than once)."""
        array = self._array.copy()
        words = array.data.cast("B").cast("Q")  # [base0, len0, base1, len1, ...]
        original = self._array.data.cast("B").cast("Q")
        fd, base, count = sock.fileno(), array.ctypes.data, len(array)
        timeout = sock.gettimeout()
        poller: select.poll | None = None
        done = index = 0
        while done < self.nbytes:
            if deadline < math.inf and time.monotonic() > deadline:
                raise TimeoutError(f"{call.__name__} cut off at its deadline after {done} bytes")
            offer = bisect.bisect_left(self._ends, done + OFFER_BYTES, lo=index) + 1 - index
            moved = call(fd, base + index * _IOVEC_BYTES, min(IOV_MAX, count - index, offer))
            if moved > 0:
                done += moved
                index = bisect.bisect_right(self._ends, done, lo=index)
                if index < count:  # trim the range the kernel stopped inside, if any
                    length = original[2 * index + 1]
                    cut = done - (self._ends[index] - length)
                    words[2 * index] = original[2 * index] + cut
                    words[2 * index + 1] = length - cut
                continue
            if moved == 0:
                raise ConnectionError(f"peer closed after {done} bytes")
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err not in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise OSError(err, f"{os.strerror(err)} after {done} bytes")
            if poller is None:
                poller = select.poll()
                poller.register(fd, event)
            wait_s = min(math.inf if timeout is None else timeout, deadline - time.monotonic())
            if wait_s <= 0 or not poller.poll(None if math.isinf(wait_s) else wait_s * 1000):
                raise TimeoutError(f"{call.__name__} timed out after {done} bytes")
        return done
