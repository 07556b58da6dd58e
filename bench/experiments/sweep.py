"""Interleaved sweeps: every load level is run against every system before the next
level, so slow drift of a shared machine (other processes, heat) falls on all systems
alike instead of on whichever ran last."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

from tandem.bench.loadgen.load import LoadConfig
from tandem.bench.loadgen.runner import BenchConfig, BenchResult, run_benchmark, sweep_points
from tandem.bench.loadgen.tables import SweepPoint

logger = logging.getLogger(__name__)


async def interleaved_sweep(
    configs: Mapping[str, BenchConfig], loads: Sequence[LoadConfig]
) -> dict[str, list[BenchResult]]:
    """`configs`: system label → its bench config (its `load` is ignored); one run per
    (load, system), in load-major order."""
    results: dict[str, list[BenchResult]] = {label: [] for label in configs}
    for index, load in enumerate(loads):
        for label, config in configs.items():
            level = load.concurrency if load.concurrency is not None else f"{load.rate_rps} req/s"
            logger.info("%s at %s", label, level)
            workload = replace(config.workload, seed=config.workload.seed + index)
            result = await run_benchmark(replace(config, load=load, workload=workload))
            results[label].append(result)
    return results


def series(results: Mapping[str, Sequence[BenchResult]]) -> dict[str, list[SweepPoint]]:
    """Plot series: system label → its points."""
    return {label: sweep_points(runs) for label, runs in results.items()}
