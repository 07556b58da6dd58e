"""`tandem-bench engine --step-profile`: where one engine step's time goes, next to its floor.

For decode batches of 1, 8 and 32 (1 and 8 with `--quick`) it times, in one torch thread
and in thread CPU time (what this thread ran, not what other processes took from it),
the whole `Engine.step()` and its parts: scheduling, input preparation, the model
forward (attention metadata included), sampling, request updates and detokenizing; and, in
alternation with the steps, the bare matmul floor (`measure.matmul_floor_timer`); the
step less its floor is the cost beyond the matmuls. The minimum over the runs stands for
the cost on a quiet machine. Then a few steps under
`torch.profiler`: op calls per step and the ops with the largest self time. Prints only;
the published table is `tandem-bench engine`'s.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from tandem.bench.engine import measure
from tandem.bench.harness import ensure_model
from tandem.engine.dtype import auto_dtype
from tandem.engine.llm_engine import Engine

NUM_RUNS = 40
NUM_PROFILE_STEPS = 3
NUM_TOP_OPS = 12
PROMPT_LEN = 128


class PartTimer:
    """Wraps methods so each call adds its thread CPU nanoseconds to a named part."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}

    def wrap(self, owner: Any, attr: str, part: str) -> None:
        inner: Callable[..., Any] = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                self.ns[part] = self.ns.get(part, 0) + time.thread_time_ns() - start

        setattr(owner, attr, timed)


def instrument(engine: Engine) -> PartTimer:
    """A timer over the parts of `engine.step()` (the engine is changed in place)."""
    timer = PartTimer()
    runner = engine.runner
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(runner, "_prepare", "inputs")
    # The forward by whichever path the step takes (the CPU stack op, a graph replay, or
    # the Python model after its attention metadata).
    timer.wrap(runner, "_forward", "forward")
    timer.wrap(runner.model, "compute_logits", "lm_head")
    timer.wrap(runner.sampler, "sample", "sample")
    timer.wrap(engine.scheduler, "update", "update")
    timer.wrap(engine, "_emit", "detokenize")
    return timer


def _cpu_ns(fn: Callable[[], object]) -> int:
    start = time.thread_time_ns()
    fn()
    return time.thread_time_ns() - start


def profile_batch(engine: Engine, timer: PartTimer, batch_size: int) -> str:
    """One report line per decode batch size, then its top ops."""
    floor = measure.matmul_floor_timer(engine.runner.model, batch_size, batch_size)
    best: dict[str, int] = {}
    max_tokens = NUM_RUNS + NUM_PROFILE_STEPS + 4
    with measure.decode_batch(engine, batch_size, PROMPT_LEN, max_tokens) as batch:
        batch.step()
        floor()
        for _ in range(NUM_RUNS):
            timer.ns.clear()
            timer.ns["step"] = _cpu_ns(batch.step)
            timer.ns["floor"] = _cpu_ns(floor)
            for part, ns in timer.ns.items():
                best[part] = min(best.get(part, ns), ns)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(NUM_PROFILE_STEPS):
                batch.step()
    parts = " ".join(f"{part} {ns / 1e6:.2f}" for part, ns in best.items())
    events = prof.key_averages()
    calls = sum(e.count for e in events) / NUM_PROFILE_STEPS
    lines = [
        f"decode b{batch_size}: step/floor {best['step'] / best['floor']:.3f}, "
        f"{(best['step'] - best['floor']) / 1e6:.2f} ms beyond the matmuls "
        f"(min thread CPU ms: {parts}); {calls:.0f} op calls per step; top self times:"
    ]
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:NUM_TOP_OPS]
    for event in ranked:
        us = event.self_cpu_time_total / NUM_PROFILE_STEPS
        lines.append(f"    {event.key:<52} {us:9.0f} us  x{event.count / NUM_PROFILE_STEPS:.0f}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    ensure_model(args.model, "small")
    batch_sizes = (1, 8) if args.quick else (1, 8, 32)
    dtype = args.dtype or "float32"
    if dtype == "auto":
        dtype = auto_dtype("cpu", "float32")
    max_len = PROMPT_LEN + NUM_RUNS + NUM_PROFILE_STEPS + 8
    engine = measure.build_engine(str(args.model), dtype, 1, 512, max(batch_sizes), max_len)
    timer = instrument(engine)
    print(f"{dtype}, 1 torch thread, {NUM_RUNS} runs, context {PROMPT_LEN}+", flush=True)
    for batch_size in batch_sizes:
        print(profile_batch(engine, timer, batch_size), flush=True)
    return 0
