"""Builds and loads the CPU paged-decode op (paged_decode.cpp), once per machine.

`torch.utils.cpp_extension.load` compiles it with the host's compiler (g++, ninja) on
first use and caches the library under `TORCH_EXTENSIONS_DIR` (default
~/.cache/torch_extensions): later starts, and concurrent ones (a file lock), load the
cached build in well under a second. It runs on torch's own thread pool
(`at::parallel_for`), so it adds no second OpenMP runtime. Loaded, it is
`torch.ops.tandem_cpu.paged_decode`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "paged_decode.cpp"
# The cache folder's name: a change of source or flags rebuilds it (torch hashes both).
# `-march=native` makes a build fit only CPUs with this one's instruction sets, so the
# name carries them too: a home directory shared by different CPUs keeps one build each.
EXTENSION_BASE_NAME = "tandem_cpu_paged_decode"
# -ffast-math lets the compiler vectorize the reductions and exp. -fopenmp makes
# `at::parallel_for` (an inline template) really parallel and honours the `omp simd`
# hints; no OpenMP library is linked, so the op's GOMP calls resolve to the libgomp torch
# itself loads: one OpenMP runtime, one thread pool (without the flag the op ran on one
# thread whatever torch's thread count).
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


@functools.cache
def cpu_paged_op_error() -> str | None:
    """Why the op cannot be built or loaded here, or None once it is loaded (built first
    if this machine has no cached build)."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH"
    started = time.perf_counter()
    try:
        _put_ninja_on_path()
        cpp_extension.load(
            name=f"{EXTENSION_BASE_NAME}_{cpu_fingerprint()}",
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler or ninja, a failed build: the reason is the answer
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[-1] if lines else ''}"
    logger.info("cpu paged-decode op loaded in %.1fs", time.perf_counter() - started)
    return None


def cpu_fingerprint() -> str:
    """8 hex digits naming this CPU's architecture and instruction-set flags."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    key = f"{platform.machine()} {flags}"
    return hashlib.sha1(key.encode()).hexdigest()[:8]


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; a venv's own (the `ninja` package) is not on it when
    the venv is not activated (`.venv/bin/tandem serve`, Ray workers)."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """out[i] = attention of query[i] (one token) over its first seq_lens[i] cached
    positions, read through block_tables[i] (int32); GQA by head groups."""
    torch.ops.tandem_cpu.paged_decode(query, kv_cache, block_tables, seq_lens, scale, out)
