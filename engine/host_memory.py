"""Keeps a CPU engine's freed activations in the process, out of the page-fault path.

glibc's malloc serves large blocks with mmap and hands freed memory back to the kernel,
and a step allocates and frees tens of MB of activations (a 512-token prefill of the
`small` preset: ~22 MB per layer). So each step faulted its activation pages in again, a
page at a time inside the matmuls that first wrote them: 3,800-16,000 minor faults per
512-token prefill step with glibc's defaults; 0 once freed memory stays in the heap and
the heap has grown to its steady size, a few steps after start (up to ~1,100 in one of
those first steps; getrusage around `Engine.step`; tests/engine/test_host_memory.py). A
serving process then keeps about one step's activations beyond its steady state.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

logger = logging.getLogger(__name__)

# mallopt(3) parameters (glibc's malloc.h) and the value they get: blocks below it come
# from the heap, and the heap keeps up to it free before trimming.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Raise this process's glibc malloc mmap and trim thresholds to `KEEP_BYTES`; False
    (and nothing changed) where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    done = libc.mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES) == 1
    done = libc.mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES) == 1 and done
    if not done:
        logger.warning("mallopt refused the mmap/trim thresholds; steps may page-fault")
    return done
