"""A child process whose Triton runs interpreted (TRITON_INTERPRET=1, CPU tensors).

`triton.jit` fixes a function's form (compiled or interpreted) when its module is
imported, and importing torch's dynamo or transformers imports triton, so the test
process (which has long imported both) cannot switch. The variable is therefore set
only in the environment a fresh spawned process starts with; tests submit top-level
functions to it and get their results (or their assertion errors) back.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

import pytest

START_TIMEOUT_S = 180.0


def _ready() -> bool:
    """Runs in the child: threads kept to one, and the kernels must import interpreted."""
    import torch

    torch.set_num_threads(1)
    from tandem.engine.attention import triton_kernels

    return type(triton_kernels.attention_kernel).__name__ == "InterpretedFunction"


@contextmanager
def interpreter_process() -> Iterator[ProcessPoolExecutor]:
    """One spawned process started with TRITON_INTERPRET=1 (the test process unchanged)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        try:
            # The child starts here, inheriting this environment.
            interpreted = pool.submit(_ready).result(timeout=START_TIMEOUT_S)
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    try:
        assert interpreted, "the child's Triton kernels are not interpreted"
        yield pool
    finally:
        pool.shutdown(cancel_futures=True)
