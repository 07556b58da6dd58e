"""Receive buffers recycled once nothing references them.

Filling fresh memory is slow: the kernel faults in and zeroes each 4 KiB page as the
socket writes it, which on loopback costs about as much as the copy itself. A pull's
result tensor is therefore carved from a pooled buffer: the tensor wraps a numpy view
of it, and when the last tensor (or view) using that memory is gone, the view's
finalizer hands the buffer back for the next pull. Nothing is ever reused while
referenced. At most `max_pooled_bytes` of idle buffers are kept. Buffers are torch
allocations: numpy-allocated ones (numpy advises huge pages for large arrays) measured
up to 2x slower to receive into on the development VM.
"""

from __future__ import annotations

import math
import threading
import weakref

import numpy as np
import torch


class BufferPool:
    """Thread-safe; buffers are flat uint8 tensors."""

    def __init__(self, max_pooled_bytes: int) -> None:
        if max_pooled_bytes < 0:
            raise ValueError(f"max_pooled_bytes must be >= 0, got {max_pooled_bytes}")
        self.max_pooled_bytes = max_pooled_bytes
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._closed = False

    @property
    def pooled_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._free)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Like `torch.empty(shape, dtype=dtype)` on CPU, on recycled memory when it can."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0 or nbytes > self.max_pooled_bytes:
            return torch.empty(shape, dtype=dtype)
        base = self._take(nbytes)
        if base is None:
            base = torch.empty(nbytes, dtype=torch.uint8)
        view: np.ndarray = base.numpy()[:nbytes]  # a new array: its death returns `base`
        weakref.finalize(view, self._give_back, base)
        return torch.from_numpy(view).view(dtype).view(shape)

    def close(self) -> None:
        """Drop the idle buffers; buffers still in use are freed, not pooled, later."""
        with self._lock:
            self._closed = True
            self._free.clear()

    def _take(self, nbytes: int) -> torch.Tensor | None:
        # Smallest buffer that fits without wasting more than half of it.
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if nbytes <= b.nbytes <= 2 * nbytes]
            if not fits:
                return None
            return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))

    def _give_back(self, base: torch.Tensor) -> None:
        with self._lock:
            pooled = sum(b.nbytes for b in self._free)
            if not self._closed and pooled + base.nbytes <= self.max_pooled_bytes:
                self._free.append(base)
