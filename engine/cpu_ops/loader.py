"""Builds and loads Tandem's CPU ops (the .cpp files beside this one), once per machine.

`torch.utils.cpp_extension.load` compiles them with the host's compiler (g++, ninja) on
first use and caches the library under `TORCH_EXTENSIONS_DIR` (default
~/.cache/torch_extensions): later starts, and concurrent ones, load the cached build in
well under a second. Concurrent starts take turns by a kernel file lock of our own
(`flock`, freed when its holder exits however it exits): torch's own lock is a file that
a process killed mid-build leaves behind, and every later load waited on it forever
(`FileBaton.wait` has no timeout); under our lock such a file is stale and removed. They
run on torch's own thread pool (`at::parallel_for`), so they add no second OpenMP
runtime. Loaded, they are `torch.ops.tandem_cpu.paged_decode` and `paged_prefill`
(decode and prefill attention over the paged cache, the `cpu` attention backend),
`pack_linear_weight`, `packed_linear` and `packs_bfloat16` (float32 matmuls, and
bfloat16 ones on CPUs with AMX or AVX512-BF16, over weights packed at load, see
engine/model/linear.py), `rms_norm`, `silu_and_mul` and `rotary_embedding_` (fused
float32/bfloat16 elementwise ops, see engine/model/cpu_kernels.py),
`packed_silu_and_mul` and `fuses_silu_and_mul` (the MLP's gate/up product and
SiLU-and-multiply in one pass, bfloat16 with AMX), `greedy_argmax` (the greedy sampler's
choice, engine/sampler.py), `cache_kv` (the K/V writes by slot) and `decoder_stack` (a
step's decoder stack, see engine/model/cpu_stack.py); cpu_ops.h declares them all,
register_ops.cpp registers them.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).parent / name
    for name in (
        "paged_decode.cpp",
        "paged_prefill.cpp",
        "packed_linear.cpp",
        "elementwise.cpp",
        "greedy_argmax.cpp",
        "decoder_stack.cpp",
        "register_ops.cpp",
    )
]
# The cache folder's name (`extension_name`): a change of source or flags rebuilds it
# (torch hashes both). `-march=native` makes a build fit only CPUs with this one's
# instruction sets, so the name carries them too: a home directory shared by different
# CPUs keeps one build each. So does the sources' folder: torch's build file names the
# sources by absolute path, so two installs (a checkout and a clone of it) sharing one
# name rebuilt the ops whenever the other had loaded them last (30-47 s a start here,
# 152 s for a worker start waiting on the lock).
EXTENSION_BASE_NAME = "tandem_cpu_ops"
# -ffast-math lets the compiler vectorize the remaining scalar loops and reductions;
# -mprefer-vector-width=512 lets it use 16-float vectors where the CPU has them (GCC
# defaults to 8 on AVX-512 CPUs: the prefill attention's softmax took ~8% longer). -fopenmp makes
# `at::parallel_for` (an inline template) really parallel and honours the `omp simd`
# hints; no OpenMP library is linked, so the op's GOMP calls resolve to the libgomp torch
# itself loads: one OpenMP runtime, one thread pool (without the flag the op ran on one
# thread whatever torch's thread count).
# TORCH_ASSERT_ONLY_METHOD_OPERATORS: a file that includes one of ATen's every-op headers
# fails to build (each source includes only the tensor type and the ops it calls: a cold
# build took ~45 s with ATen.h in every file).
CFLAGS = [
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-ffast-math",
    "-fopenmp",
    "-DTORCH_ASSERT_ONLY_METHOD_OPERATORS",
]


# How long a start waits for another process's build of the ops to finish (a cold build
# took ~45 s on 2 cores).
BUILD_WAIT_S = 900.0


@functools.cache
def cpu_ops_error() -> str | None:
    """Why the ops cannot be built or loaded here, or None once they are loaded (built
    first if this machine has no cached build)."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH"
    started = time.perf_counter()
    name = extension_name()
    try:
        _put_ninja_on_path()
        with build_lock(build_directory(name), BUILD_WAIT_S):
            cpp_extension.load(
                name=name,
                sources=[str(source) for source in SOURCES],
                extra_cflags=CFLAGS,
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # no compiler or ninja, a failed build: the reason is the answer
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[-1] if lines else ''}"
    logger.info("cpu ops loaded in %.1fs", time.perf_counter() - started)
    return None


def build_directory(name: str) -> Path:
    """Where torch builds and caches the extension `name` (created if absent)."""
    from torch.utils import cpp_extension

    # torch's own rule (TORCH_EXTENSIONS_DIR, else its default root and a Python/CUDA
    # folder); private, so a torch that renames it fails here, loudly, not silently.
    return Path(cpp_extension._get_build_directory(name, verbose=False))


@contextlib.contextmanager
def build_lock(build_dir: Path, timeout_s: float) -> Iterator[None]:
    """Held while this process builds or loads the ops of `build_dir`: exclusive among
    Tandem processes (a `flock` on a file beside it), waited for at most `timeout_s`
    (TimeoutError). Held, it removes torch's lock file in `build_dir` if one is there:
    every builder takes this lock first, so that file is a killed build's."""
    lock_path = build_dir.with_name(build_dir.name + ".tandem-lock")
    deadline = time.monotonic() + timeout_s
    with open(lock_path, "a") as lock_file:
        while True:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another process has held {lock_path} for over {timeout_s:g} s "
                        "(building the cpu ops)"
                    ) from None
                time.sleep(0.1)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a build of the cpu ops that was killed",
                               stale)  # fmt: skip
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def extension_name() -> str:
    """The ops' cache folder name: this CPU's fingerprint and 8 hex digits of where the
    sources are (see EXTENSION_BASE_NAME)."""
    where = hashlib.sha1(str(SOURCES[0].parent.resolve()).encode()).hexdigest()[:8]
    return f"{EXTENSION_BASE_NAME}_{cpu_fingerprint()}_{where}"


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


# paged_prefill's head dims: whole 16-float vectors.
PREFILL_HEAD_DIM_MULTIPLE = 16


def paged_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
    out: torch.Tensor,
) -> None:
    """out = causal attention of one float32 or bfloat16 prefill chunk's queries [T, Hq,
    D] (token i at position context_len + i) over the cached positions 0..context_len + T
    - 1, read through block_table (int64; the chunk's own K/V already written); GQA by
    head groups; head dims a multiple of PREFILL_HEAD_DIM_MULTIPLE."""
    torch.ops.tandem_cpu.paged_prefill(query, kv_cache, block_table, context_len, scale, out)


def packs_bfloat16() -> bool:
    """Whether `pack_linear_weight` and `packed_linear` take bfloat16 on this CPU: with
    AMX (torch's batch-reduce GEMM) or AVX512-BF16 (the op's own kernel). False where the
    ops do not build."""
    return cpu_ops_error() is None and bool(torch.ops.tandem_cpu.packs_bfloat16())


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float32 (or, where `packs_bfloat16`, bfloat16) weight [n, k] in the column panels
    `packed_linear` reads, zero past row n: a new tensor [ceil(n / width), k, width] in
    float32 (the width is the build's), [ceil(n / 64), k / 2, 64, 2] in bfloat16 (k even;
    pairs of k side by side, the batch-reduce GEMM's layout)."""
    return torch.ops.tandem_cpu.pack_linear_weight(weight)


def packed_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias) as a new [rows, n] tensor of x's dtype, for x [rows, k] with k
    contiguous and `packed` = pack_linear_weight(weight [n, k]) of that dtype; plus
    `residual` (contiguous [rows, n], x's dtype) where given, the same bits as adding it to
    the result with `add_`."""
    return torch.ops.tandem_cpu.packed_linear(x, packed, n, bias, residual)


def fuses_silu_and_mul(packed_gate_up: torch.Tensor, intermediate: int) -> bool:
    """Whether `packed_silu_and_mul` takes this packed gate_up weight [2I, k]: bfloat16
    packed for AMX, I a multiple of its 64-column panels."""
    return bool(torch.ops.tandem_cpu.fuses_silu_and_mul(packed_gate_up, intermediate))


def packed_silu_and_mul(
    x: torch.Tensor, packed_gate_up: torch.Tensor, intermediate: int
) -> torch.Tensor:
    """silu_and_mul(packed_linear(x, packed_gate_up, 2 * intermediate, None)), the same
    bits, without the [rows, 2I] product in memory (where `fuses_silu_and_mul`)."""
    return torch.ops.tandem_cpu.packed_silu_and_mul(x, packed_gate_up, intermediate)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of float32 or bfloat16 rows x [T, H] (rows contiguous) times weight [H] of
    the same dtype, in one pass per row: a new [T, H] tensor."""
    return torch.ops.tandem_cpu.rms_norm(x, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of float32 or bfloat16 rows gate_up [T, 2I] ([gate | up]): a new
    [T, I]."""
    return torch.ops.tandem_cpu.silu_and_mul(gate_up)


def rotary_embedding_(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int
) -> None:
    """RoPE in place on the first `num_heads` heads of each float32 or bfloat16 row of qkv,
    by cos and signed sin [T, 1, D] of its dtype (engine/model/rotary.py's tables), the
    same bits as `apply_rotary_`."""
    torch.ops.tandem_cpu.rotary_embedding_(qkv, cos, sin, num_heads, head_dim)


def cache_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Each token's key and value [tokens, kv_heads, head_dim] into its slot
    (slot_mapping, int64) of kv_cache [2, blocks, block_size, kv_heads, head_dim]."""
    torch.ops.tandem_cpu.cache_kv(key, value, kv_cache, slot_mapping)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Per row of float32 or bfloat16 logits [rows, vocab], the first index of its maximum
    (a NaN counts as the maximum), as int64 [rows]: what `logits.max(dim=-1).indices`
    gives."""
    return torch.ops.tandem_cpu.greedy_argmax(logits)
