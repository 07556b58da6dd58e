"""`tandem-bench engine --attention`: CPU decode attention per layer, `cpu` vs `torch`.

The `cpu` backend (paged decode in a C++ op reading the cache in place) against the
`torch` backend (per-layer gather of each decode group's blocks + SDPA) on decode-only
batches shaped like tandem-small (12 query / 4 KV heads, head_dim 64, block size 16,
float32), at batch 8 and 32, contexts ~140 and ~1000 (each row's length drawn within
+-20%). One sample is one `forward` (K/V write + attention) over each of `LAYERS`
separate caches, so the caches do not stay in the CPU's cache as one layer's would.
Samples alternate between backends (load skews both alike); the result is the median
per layer, as wall time and as the process's CPU time (less sensitive to other processes).
Also the op's one-time cost: a cold build into an empty extensions folder and a warm
load from it, each in a fresh process.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.bench.report import (
    format_ms,
    machine_facts,
    machine_sentence,
    publish,
    render_table,
    write_json,
)
from tandem.engine.attention import BatchLayout
from tandem.engine.attention.cpu_paged_backend import CpuPagedAttentionBackend
from tandem.engine.attention.torch_backend import TorchAttentionBackend
from tandem.engine.cpu_ops.loader import cpu_ops_error

SECTION_HEADING = "## CPU decode attention: paged C++ op vs gather + SDPA"
RESULTS_PATH = Path("bench/results/cpu_attention.json")
FULL_COMMAND = "tandem-bench engine --attention"
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 4, 64, 16
LAYERS = 6
SHAPES = ((8, 140), (32, 140), (8, 1000), (32, 1000))
THREADS = (1, 2)


@dataclass
class AttentionRow:
    batch_size: int
    context: int
    threads: int
    # Median seconds per layer, by backend name: wall time and the process's CPU time.
    wall_s: dict[str, float] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)


@dataclass
class AttentionReport:
    command: str
    quick: bool
    machine: dict
    rounds: int
    build_s: float = float("nan")
    load_s: float = float("nan")
    rows: list[AttentionRow] = field(default_factory=list)
    wall_s: float = 0.0


def decode_batch(batch_size: int, context: int, seed: int) -> tuple[BatchLayout, torch.Tensor]:
    """A decode-only layout over shuffled blocks, and the step's fused q/k/v [B, H, D]."""
    rng = random.Random(seed)
    lens = sorted((rng.randint(context * 4 // 5, context * 6 // 5) for _ in range(batch_size)),
                  reverse=True)  # fmt: skip
    counts = [-(-n // BLOCK_SIZE) for n in lens]
    order = list(range(1, sum(counts) + 1))
    rng.shuffle(order)
    tables = []
    for count in counts:
        tables.append(order[:count])
        order = order[count:]
    slots = [t[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
             for t, n in zip(tables, lens, strict=True)]  # fmt: skip
    layout = BatchLayout(
        query_start_loc=list(range(batch_size + 1)),
        seq_lens=lens,
        block_tables=tables,
        slots=slots,
        num_decodes=batch_size,
        block_size=BLOCK_SIZE,
        device=torch.device("cpu"),
    )
    return layout, torch.randn(batch_size, HEADS + 2 * KV_HEADS, HEAD_DIM)


def measure_shape(batch_size: int, context: int, threads: int, rounds: int) -> AttentionRow:
    torch.set_num_threads(threads)
    layout, qkv = decode_batch(batch_size, context, seed=batch_size * 7919 + context)
    query, key, value = qkv.split((HEADS, KV_HEADS, KV_HEADS), dim=1)
    num_blocks = sum(len(t) for t in layout.block_tables) + 1
    caches = [torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    scale = HEAD_DIM**-0.5
    backends = {"torch": TorchAttentionBackend(scale), "cpu": CpuPagedAttentionBackend(scale)}
    metas = {name: backend.build_metadata(layout) for name, backend in backends.items()}
    outs = [b.forward(query, key, value, caches[0], metas[n]) for n, b in backends.items()]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    wall: dict[str, list[float]] = {name: [] for name in backends}
    cpu: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(rounds):
        for name, backend in backends.items():
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            for cache in caches:
                backend.forward(query, key, value, cache, metas[name])
            cpu[name].append((time.process_time() - cpu_start) / LAYERS)
            wall[name].append((time.perf_counter() - wall_start) / LAYERS)
    row = AttentionRow(batch_size, context, threads)
    for name in backends:
        row.wall_s[name] = sorted(wall[name])[len(wall[name]) // 2]
        row.cpu_s[name] = sorted(cpu[name])[len(cpu[name]) // 2]
    return row


def one_time_cost() -> tuple[float, float]:
    """Seconds `cpu_ops_error()` takes in a new process (what each `tandem serve`
    process pays at start-up): a cold build into an empty extensions folder, then a load
    of that cached build."""
    script = (
        "import sys, time\n"
        "from tandem.engine.cpu_ops.loader import cpu_ops_error\n"
        "start = time.perf_counter()\n"
        "error = cpu_ops_error()\n"
        "print(time.perf_counter() - start)\n"
        "sys.exit(error)\n"
    )
    seconds = []
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": folder}
        for _ in range(2):
            done = subprocess.run(
                [sys.executable, "-c", script],
                env=env, check=True, timeout=900, capture_output=True, text=True,
            )  # fmt: skip
            seconds.append(float(done.stdout.split()[-1]))
    return seconds[0], seconds[1]


def render_section(result: AttentionReport) -> list[str]:
    header = ["batch", "context", "threads", "torch (gather + SDPA)", "cpu (paged op)",
              "speed-up (wall)", "speed-up (CPU time)"]  # fmt: skip
    rows = [
        [str(r.batch_size), f"~{r.context}", str(r.threads), format_ms(r.wall_s["torch"], 3),
         format_ms(r.wall_s["cpu"], 3), f"{r.wall_s['torch'] / r.wall_s['cpu']:.2f}x",
         f"{r.cpu_s['torch'] / r.cpu_s['cpu']:.2f}x"]
        for r in result.rows
    ]  # fmt: skip
    quick = " (`--quick`: a smoke run, not a measurement)" if result.quick else ""
    cost = (
        "The op's one-time cost: not measured by `--quick`."
        if result.quick
        else f"The op's one-time cost: a cold build {result.build_s:.1f} s; later starts "
        f"load the cached build in {result.load_s:.2f} s."
    )
    text = (
        f"Command: `{FULL_COMMAND}`. This run: `{result.command}`{quick}, "
        f"{result.wall_s / 60:.1f} min.\n\n"
        f"{machine_sentence(result.machine, os.getloadavg())}\n\n"
        f"Decode attention per layer (K/V write included), float32, {HEADS} query / "
        f"{KV_HEADS} KV heads, head_dim {HEAD_DIM}, block size {BLOCK_SIZE}, {LAYERS} "
        f"separate layer caches; median over {result.rounds} alternating rounds (wall "
        f"time; the speed-up also by the process's CPU time). {cost}\n\n"
        + render_table(header, rows)
    )
    return [text]


def main(args: argparse.Namespace) -> int:
    error = cpu_ops_error()
    if error is not None:
        print(f"tandem-bench engine --attention: the cpu op does not build: {error}")
        return 1
    out = args.out if args.out is not None or args.quick else "docs/benchmarks.md"
    started = time.perf_counter()
    rounds = 5 if args.quick else 31
    result = AttentionReport(args.command, bool(args.quick), machine_facts(), rounds)
    shapes, threads = (SHAPES[:2], THREADS[:1]) if args.quick else (SHAPES, THREADS)
    for count in threads:
        for batch_size, context in shapes:
            row = measure_shape(batch_size, context, count, rounds)
            print(f"batch {batch_size} ctx ~{context} threads {count}: torch "
                  f"{format_ms(row.wall_s['torch'], 3)}, cpu {format_ms(row.wall_s['cpu'], 3)}",
                  flush=True)  # fmt: skip
            result.rows.append(row)
    if not args.quick:
        result.build_s, result.load_s = one_time_cost()
    result.wall_s = time.perf_counter() - started
    path = RESULTS_PATH.with_stem("cpu_attention-quick") if args.quick else RESULTS_PATH
    write_json(path, result)
    publish(out, SECTION_HEADING, render_section(result))
    return 0
