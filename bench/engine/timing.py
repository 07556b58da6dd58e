"""The one stopwatch the engine benchmark's timers share (engine, transformers, matmuls)."""

from __future__ import annotations

import time
from collections.abc import Callable


def time_call(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
