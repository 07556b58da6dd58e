"""`tandem profile`: measure this hardware with the real engine and the real KV transport.

- Prefill: one engine step prefilling a prompt of `n` tokens, for several `n`, and
  again with a cached prefix (the same prompt's first blocks served by the prefix
  cache) — the step time per computed and per cached token.
- Decode: one decode step of `batch` sequences of `context` tokens each, for a grid of
  both (the median of a few steps).
- KV transfer: a prefill-side `KvTransferService` (gRPC + TCP data server) in a
  separate process serving a paged cache of this model's layout, pulled by a
  `KvTransferClient` here — the same code two workers use — for several prompt sizes.

Each point is the median of `repeats` runs after one warm-up. `quick` uses fewer,
smaller points (a few minutes on 2 CPU cores with a small model).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.engine.config import EngineConfig, EngineMode
from tandem.engine.host_cpus import available_cpus
from tandem.engine.llm_engine import Engine
from tandem.engine.sampling_params import SamplingParams
from tandem.planner.profile_format import (
    DecodeSample,
    EngineLimits,
    PrefillSample,
    Profile,
    TransferSample,
)

logger = logging.getLogger(__name__)

_FIRST_ID = 10

# n -> n random token ids
TokenIds = Callable[[int], list[int]]


@dataclass(frozen=True)
class ProfileGrid:
    prompt_tokens: tuple[int, ...]
    cached_shares: tuple[float, ...]
    batch_sizes: tuple[int, ...]
    context_tokens: tuple[int, ...]
    transfer_tokens: tuple[int, ...]
    repeats: int

    @classmethod
    def make(cls, quick: bool) -> ProfileGrid:
        if quick:
            return cls((32, 128, 384, 768), (0.5,), (1, 4, 16), (64, 512), (256, 2048), 3)
        return cls(
            (16, 64, 256, 512, 1024, 2048), (0.25, 0.5, 0.9), (1, 2, 8, 32, 64),
            (64, 512, 2048), (256, 2048, 8192), 5,
        )  # fmt: skip


def measure_profile(
    model_dir: str,
    device: str,
    num_threads: int | None,
    quick: bool,
    seed: int = 0,
    grid: ProfileGrid | None = None,
) -> Profile:
    """Measure prefill, decode and KV transfer on this machine into a `Profile` (on
    `grid`, default the quick or the full one)."""
    grid = grid or ProfileGrid.make(quick)
    if num_threads:
        torch.set_num_threads(num_threads)
    base = EngineConfig(model=model_dir, device=device, num_threads=num_threads)
    limit = base.max_model_len
    prompts = tuple(n for n in grid.prompt_tokens if n < limit)
    contexts = tuple(n for n in grid.context_tokens if n + 8 < limit)
    budget = max([*prompts, max(grid.batch_sizes)])
    engine = Engine(
        EngineConfig(
            model=model_dir,
            device=device,
            num_threads=num_threads,
            mode=EngineMode.COLOCATED,
            max_num_batched_tokens=max(budget, base.max_num_batched_tokens),
        )
    )
    config = engine.config
    gen = torch.Generator().manual_seed(seed)
    vocab = config.model_config.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(_FIRST_ID, vocab, (n,), generator=gen).tolist()

    prefill = _measure_prefill(engine, ids, prompts, grid)
    decode = _measure_decode(engine, ids, grid.batch_sizes, contexts, grid.repeats)
    transfer = measure_transfer(config, grid.transfer_tokens, grid.repeats)
    mc = config.model_config
    return Profile(
        hardware={
            "device": device,
            "processor": platform.processor() or platform.machine(),
            "num_threads": torch.get_num_threads(),
            "num_cores": available_cpus(),
            "dtype": str(config.torch_dtype).removeprefix("torch."),
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        },
        model={
            "path": model_dir,
            "num_layers": mc.num_layers,
            "kv_bytes_per_token": mc.kv_bytes_per_token,
        },
        engine=EngineLimits(
            block_size=config.block_size,
            max_num_batched_tokens=base.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            num_blocks=config.num_blocks,
            max_model_len=config.max_model_len,
        ),
        prefill=tuple(prefill),
        decode=tuple(decode),
        transfer=tuple(transfer),
    )


def _timed_step(engine: Engine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def _measure_prefill(
    engine: Engine, ids: TokenIds, prompts: Sequence[int], grid: ProfileGrid
) -> list[PrefillSample]:
    samples = []
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    count = 0
    for n in prompts:
        for share in (0.0, *grid.cached_shares):
            times, cached = [], 0
            for round_ in range(grid.repeats + 1):
                prompt = ids(n)
                if share > 0:  # warm the cache with the prefix, then time the whole prompt
                    engine.add_request(f"warm-{count}", prompt[: int(n * share)], params)
                    while engine.has_unfinished_requests():
                        engine.step()
                count += 1
                request = engine.add_request(f"p-{count}", prompt, params)
                seconds = _timed_step(engine)
                while engine.has_unfinished_requests():
                    engine.step()
                cached = request.num_cached_tokens
                if round_:
                    times.append(seconds)
            samples.append(PrefillSample(n, cached, statistics.median(times)))
            logger.info("prefill %d tokens (%d cached): %.4f s", n, cached, samples[-1].seconds)
    return samples


def _measure_decode(
    engine: Engine,
    ids: TokenIds,
    batches: Sequence[int],
    contexts: Sequence[int],
    repeats: int,
) -> list[DecodeSample]:
    samples = []
    for context in contexts:
        for batch in batches:
            params = SamplingParams(max_tokens=repeats + 3, temperature=0.0, ignore_eos=True)
            for i in range(batch):
                engine.add_request(f"d-{context}-{batch}-{i}", ids(context), params)
            # Prefill every prompt (and take token 1), then time pure decode steps.
            while any(r.num_computed_tokens < r.num_prompt_tokens
                      for r in engine.scheduler.running) or engine.scheduler.waiting:  # fmt: skip
                engine.step()
            engine.step()
            times = [_timed_step(engine) for _ in range(repeats)]
            while engine.has_unfinished_requests():
                engine.step()
            total = batch * (context + 2)
            samples.append(DecodeSample(batch, total, statistics.median(times)))
            logger.info("decode batch %d x %d ctx: %.4f s", batch, context, samples[-1].seconds)
    return samples


def measure_transfer(
    config: EngineConfig, sizes: Sequence[int], repeats: int
) -> list[TransferSample]:
    """KV pulls over TCP from a prefill-side service in another process."""
    from tandem.planner.profile_transfer import pull_times

    kept = [n for n in sizes if n < config.max_model_len * 8]
    return asyncio.run(pull_times(config, kept, repeats, mp.get_context("spawn")))
