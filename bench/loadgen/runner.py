"""One benchmark run, or a sweep of runs, from a `BenchConfig`: the API experiments use."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tandem.bench.loadgen.clients import Client, ClientConfig, ServerInfo, make_client
from tandem.bench.loadgen.load import Injection, LoadConfig, LoadResult, run_load
from tandem.bench.loadgen.metrics import RunSummary, SloTargets, summarize
from tandem.bench.loadgen.tables import SweepPoint
from tandem.bench.loadgen.workloads import (
    LONG_TAG,
    ChatMix,
    ChatWorkload,
    FixedWorkload,
    MixedWorkload,
    Vocab,
)
from tandem.bench.report import plain

logger = logging.getLogger(__name__)

WORKLOAD_KINDS = ("fixed", "chat", "mixed")
# Bumped when the results JSON changes shape.
RESULTS_VERSION = 1
# Used to clip the chat mix when the server does not say its limit.
DEFAULT_MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str = "fixed"
    input_len: int | None = None  # prompt tokens (chat: the mean; None = 128, chat: ChatMix's)
    output_len: int | None = None  # output tokens (chat: the mean; None = 128, chat: ChatMix's)
    vocab_size: int | None = None  # token ids are drawn below this; None = the server's
    max_model_len: int | None = None  # chat/mixed: clip prompt + output; None = server's limit
    seed: int = 0
    long_fraction: float = 0.1  # mixed: share of documents (prompt ≈ long_input_len ± 25%)
    long_input_len: int = 2048
    long_output_len: int = 16

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"workload must be one of {WORKLOAD_KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class LongPromptConfig:
    """Long prompts injected over the main load (head-of-line blocking experiments)."""

    at_s: tuple[float, ...]  # send offsets, seconds from the run's start; one long request each
    input_len: int = 2048
    output_len: int = 16


@dataclass(frozen=True)
class BenchConfig:
    client: ClientConfig
    workload: WorkloadConfig
    load: LoadConfig
    slo: SloTargets = field(default_factory=SloTargets)
    long_prompt: LongPromptConfig | None = None
    # Sent one at a time before the run and not recorded (connections, first-call costs).
    warmup_requests: int = 1


def build_workload(
    config: WorkloadConfig, server: ServerInfo
) -> FixedWorkload | ChatWorkload | MixedWorkload:
    vocab_size = config.vocab_size or server.vocab_size
    if vocab_size is None:
        if server.prompt_format == "ids":
            raise ValueError(
                "the server does not report its vocabulary size: give vocab_size "
                "(--vocab-size) or send text prompts (--prompt-format text)"
            )
        vocab_size = 32000  # text prompts only use ids to pick words
    vocab = Vocab(vocab_size, config.seed)
    input_len, output_len = config.input_len or 128, config.output_len or 128
    if config.kind == "fixed":
        return FixedWorkload(vocab, input_len, output_len)
    defaults = ChatMix()
    mix = ChatMix(
        mean_input_len=config.input_len or defaults.mean_input_len,
        mean_output_len=config.output_len or defaults.mean_output_len,
    )
    max_model_len = config.max_model_len or server.max_model_len or DEFAULT_MAX_MODEL_LEN
    chat = ChatWorkload(vocab, mix, max_model_len)
    if config.kind == "chat":
        return chat
    return MixedWorkload(chat, config.long_fraction, config.long_input_len, config.long_output_len)


def build_injections(
    config: LongPromptConfig | None, vocab_size: int, seed: int
) -> list[Injection]:
    if config is None:
        return []
    workload = FixedWorkload(Vocab(vocab_size, seed), config.input_len, config.output_len, LONG_TAG)
    return [Injection(at_s, workload.request(i)) for i, at_s in enumerate(config.at_s)]


@dataclass(frozen=True)
class BenchResult:
    config: BenchConfig
    server: ServerInfo
    load: LoadResult
    summary: RunSummary
    by_tag: dict[str, RunSummary]  # per tag ("short", "long"), when the run had more than one

    def to_json(self) -> dict[str, Any]:
        fields = ("config", "server", "summary", "by_tag")
        data = {name: plain(getattr(self, name)) for name in fields}
        return {"version": RESULTS_VERSION, **data, "traces": plain(self.load.traces)}


def summarize_run(load: LoadResult, slo: SloTargets) -> tuple[RunSummary, dict[str, RunSummary]]:
    """The whole run's summary, and one per tag when there are several."""
    tags = sorted({t.tag for t in load.traces})
    by_tag = {
        tag: summarize([t for t in load.traces if t.tag == tag], load.duration_s, slo)
        for tag in (tags if len(tags) > 1 else [])
    }
    return summarize(load.traces, load.duration_s, slo), by_tag


async def run_benchmark(config: BenchConfig) -> BenchResult:
    """One run as `config` says (see the module docstring)."""
    results = await run_sweep(config, [config.load])
    return results[0]


async def run_sweep(config: BenchConfig, loads: Sequence[LoadConfig]) -> list[BenchResult]:
    """One run per load level, same client and same requests; `config.load` is ignored."""
    client = make_client(config.client)
    try:
        server = await client.start()
        workload = build_workload(config.workload, server)
        logger.info(
            "target %s: model %s, prompts as %s, workload %s", config.client.target,
            server.model, server.prompt_format, workload.name,
        )  # fmt: skip
        injections = build_injections(
            config.long_prompt, workload.vocab.vocab_size, config.workload.seed
        )
        await _warm_up(client, workload.vocab, config.warmup_requests)
        results = []
        for load in loads:
            result = await run_load(client, workload, load, injections)
            summary, by_tag = summarize_run(result, config.slo)
            run_config = replace(config, load=load)
            results.append(BenchResult(run_config, server, result, summary, by_tag))
        return results
    finally:
        await client.close()


async def _warm_up(client: Client, vocab: Vocab, num_requests: int) -> None:
    """Short requests of their own (tag "warmup"): they must not warm the prefix cache
    for the run's prompts."""
    warmup = FixedWorkload(vocab, input_len=16, output_len=4, tag="warmup")
    for i in range(num_requests):
        trace = await client.stream(warmup.request(i))
        if not trace.ok:
            raise RuntimeError(f"warm-up request failed: {trace.error}")


def sweep_points(results: Sequence[BenchResult]) -> list[SweepPoint]:
    return [
        SweepPoint(r.summary, r.config.load.concurrency, r.config.load.rate_rps) for r in results
    ]


def sweep_to_json(results: Sequence[BenchResult]) -> dict[str, Any]:
    """One document for a whole sweep: shared config and server, then one entry per level
    (no traces)."""
    if not results:
        raise ValueError("a sweep needs at least one result")
    config = plain(results[0].config)
    config["load"] = plain([r.config.load for r in results])
    points = [
        {"concurrency": r.config.load.concurrency, "rate_rps": r.config.load.rate_rps,
         "summary": plain(r.summary), "by_tag": plain(r.by_tag)}
        for r in results
    ]  # fmt: skip
    return {
        "version": RESULTS_VERSION, "config": config, "server": plain(results[0].server),
        "points": points,
    }  # fmt: skip
