"""What every experiment shares: where things go, which systems exist, how to reach them."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from tandem.bench.harness import ServerSpec, tandem_spec, transformers_spec
from tandem.bench.loadgen.clients import ClientConfig
from tandem.bench.loadgen.load import LoadConfig
from tandem.bench.loadgen.metrics import SloTargets
from tandem.bench.loadgen.runner import (
    BenchConfig,
    BenchResult,
    LongPromptConfig,
    WorkloadConfig,
    run_benchmark,
    sweep_points,
)
from tandem.bench.loadgen.tables import SweepPoint
from tandem.engine.config import EngineConfig

logger = logging.getLogger(__name__)

# One limit for every Tandem layout: room for the longest prompt any experiment sends.
MAX_MODEL_LEN = 2560
# The small preset's vocabulary; prompts are drawn from it whatever a server reports.
VOCAB_SIZE = 32000

_PAIR = ("--prefill", "1", "--decode", "1")
# system -> (label, `tandem serve` layout flags); the order fixes each system's ports.
SYSTEMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "disaggregated": ("tandem 1P+1D", _PAIR),
    "colocated-2": ("tandem 2 colocated", ("--colocated", "2")),
    "colocated-1": ("tandem 1 colocated, chunked", ("--colocated", "1")),
    "colocated-1-no-chunking": (
        "tandem 1 colocated, no chunking", ("--colocated", "1", "--no-chunked-prefill"),
    ),
    "transformers": ("transformers serve", ()),
    "disaggregated-remote-prefill": (
        "tandem 1P+1D, every prefill remote", (*_PAIR, "--max-local-prefill-tokens", "0"),
    ),
}  # fmt: skip


@dataclass(frozen=True)
class ExperimentSetup:
    model_dir: str = "models/tandem-small"
    results_dir: Path = Path("bench/results/experiments")  # results JSON and server logs
    img_dir: Path = Path("docs/img")  # plots (linked from the doc)
    doc_path: Path | None = Path("docs/benchmarks.md")  # the report to write; None = none
    quick: bool = False  # fewer, shorter load levels: checks the pipeline end to end
    base_port: int = 52100  # ports: system i gets grpc base+i and http base+100+i
    seed: int = 0

    def worker_kv_blocks(self) -> int:
        """KV blocks (16 tokens) of one Tandem worker's default pool: the peer gets as many."""
        blocks = EngineConfig(model=self.model_dir).num_blocks
        if blocks is None:  # `EngineConfig` sizes the pool when it is built
            raise RuntimeError(f"no KV pool size for {self.model_dir}")
        return blocks

    def server(self, system: str) -> ServerSpec:
        if system not in SYSTEMS:
            raise ValueError(f"unknown system {system!r}; one of {SYSTEMS}")
        index = list(SYSTEMS).index(system)
        grpc_port, http_port = self.base_port + index, self.base_port + 100 + index
        if system == "transformers":
            return transformers_spec(self.model_dir, http_port, self.worker_kv_blocks())
        label, layout = SYSTEMS[system]
        flags = (*layout, "--max-model-len", str(MAX_MODEL_LEN))
        return tandem_spec(label, self.model_dir, grpc_port, http_port, flags)


def workload(kind: str, input_len: int, output_len: int, seed: int, **extra: Any) -> WorkloadConfig:
    """A workload over the small preset's vocabulary, clipped to `MAX_MODEL_LEN`."""
    return WorkloadConfig(kind, input_len, output_len, VOCAB_SIZE, MAX_MODEL_LEN, seed, **extra)


def http_client(server: ServerSpec) -> ClientConfig:
    """The same OpenAI request body for every server: text prompts (`transformers serve`
    takes no token ids) and only OpenAI's fields (it refuses `ignore_eos`)."""
    return ClientConfig(server.http_url, prompt_format="text", strict_openai=True)


def grpc_client(server: ServerSpec) -> ClientConfig:
    """Tandem's gRPC API: token-id prompts, one message per token (exact arrival times)."""
    if server.grpc_target is None:
        raise ValueError(f"{server.label} has no gRPC API")
    return ClientConfig(server.grpc_target, prompt_format="ids", request_timeout_s=600)


def bench_config(
    client: ClientConfig, workload: WorkloadConfig, load: LoadConfig,
    slo: SloTargets | None = None, long_prompt: LongPromptConfig | None = None,
) -> BenchConfig:  # fmt: skip
    return BenchConfig(client, workload, load, slo or SloTargets(), long_prompt, warmup_requests=2)


class SweepPlan(Protocol):
    """What the frontier and goodput plans give: one workload, several load levels."""

    slo: SloTargets

    def workload(self, seed: int) -> WorkloadConfig: ...

    def loads(self, seed: int) -> list[LoadConfig]: ...


async def interleaved_sweep(
    plan: SweepPlan, clients: Mapping[str, ClientConfig], seed: int
) -> dict[str, list[BenchResult]]:
    """One run per (load, system) in load-major order, so slow drift of a shared machine
    (other processes, heat) falls on all systems alike instead of on whichever ran last."""
    loads = plan.loads(seed)
    configs = {
        label: bench_config(client, plan.workload(seed), loads[0], plan.slo)
        for label, client in clients.items()
    }
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
