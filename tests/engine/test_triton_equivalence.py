"""Greedy output with the Triton attention backend equals `transformers` token for
token, on CPU under Triton's interpreter: the engine (chunked prefill over cached
chunks, prefix-cache hits) in a child process, and a served 1 prefill + 1 decode Ray
cluster (`tandem serve --attention-backend triton`) whose workers start with
TRITON_INTERPRET=1. Prompts are short: the interpreter runs each kernel program in
Python."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
import ray

from tandem.cluster.cli import build_parser, cluster_config_from_args
from tandem.cluster.launcher import LocalCluster
from tandem.cluster.ray_start import start_local_ray
from tests.helpers.grpc_calls import assert_workers_idle, generate_tokens
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.kv_budget import TEST_KV_CACHE_FLAG
from tests.helpers.prompts import make_prompts
from tests.helpers.triton_interpreter import interpreter_process

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

MAX_TOKENS = 8
PROMPT_LENS = (1, 5, 17, 40, 70)
# Second wave: (first-wave prompt, tokens kept) + a new suffix: 48 and 32 cached tokens.
SHARED_PREFIXES = ((4, 48), (3, 32))


def engine_greedy(model_dir: str, waves: list[list[list[int]]]) -> tuple[list, int]:
    """In the interpreter process: each wave's greedy tokens from one Triton engine
    (32-token steps, so prompts are chunked over their cached chunks), and its prefix
    cache hits."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.generate import generate
    from tandem.engine.llm_engine import Engine
    from tandem.engine.sampling_params import SamplingParams

    config = EngineConfig(
        model=model_dir,
        attention_backend="triton",
        # Pinned: the interpreter's bfloat16 dot is wrong on CPU (`auto` may pick bf16).
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=32,
        num_blocks=64,
    )
    engine = Engine(config)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    tokens = [
        [out.token_ids for out in generate(engine, wave, params, req_id_prefix=f"w{i}")]
        for i, wave in enumerate(waves)
    ]
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks and engine.is_idle(), stats
    return tokens, stats.prefix_cache_hits


def test_engine_matches_transformers_with_triton(tiny_model_dir: Path) -> None:
    prompts = make_prompts(2048, PROMPT_LENS)
    suffixes = make_prompts(2048, (9, 5), seed=1)
    wave2 = [
        prompts[i][:keep] + s[1:] for (i, keep), s in zip(SHARED_PREFIXES, suffixes, strict=True)
    ]
    with interpreter_process() as child:
        future = child.submit(engine_greedy, str(tiny_model_dir), [prompts, wave2])
        (got1, got2), prefix_hits = future.result(timeout=300)
    assert prefix_hits > 0
    for got, wave in ((got1, prompts), (got2, wave2)):
        expected = hf_greedy(tiny_model_dir, wave, MAX_TOKENS)
        for i, (tokens, want) in enumerate(zip(got, expected, strict=True)):
            assert tokens == want, f"prompt {i} ({len(wave[i])} tokens) diverged"


def test_served_cluster_matches_transformers_with_triton(tiny_model_dir: Path) -> None:
    model_dir = str(tiny_model_dir)
    prompts = make_prompts(2048, PROMPT_LENS, seed=5)
    expected = hf_greedy(tiny_model_dir, prompts, MAX_TOKENS)
    flags = ["serve", "--model", model_dir, "--device", "cpu", "--threads", "1"]
    flags += ["--max-model-len", "256", "--attention-backend", "triton", "--dtype", "float32"]
    flags += TEST_KV_CACHE_FLAG
    with pytest.MonkeyPatch.context() as patch:
        # As `TRITON_INTERPRET=1 tandem serve ...`: Ray's worker processes inherit it
        # from start-up (before they import triton).
        patch.setenv("TRITON_INTERPRET", "1")
        config = cluster_config_from_args(build_parser().parse_args(flags))
        start_local_ray(num_cpus=4)
    assert config.engine.attention_backend == "triton"
    config.router = replace(config.router, grpc_port=0, http_port=0, warmup_profile=False)

    async def scenario() -> None:
        cluster = LocalCluster(config)
        try:
            router = await cluster.start()
            outputs = await generate_tokens(router.grpc_endpoint, prompts, MAX_TOKENS, 240)
            for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
                assert got == want, f"prompt {i} ({len(prompts[i])} tokens) diverged"
            workers = [(w.endpoint, w.role) for w in cluster.workers]
            await assert_workers_idle(workers, max_channels=1, auth=config.worker.cluster_auth)
        finally:
            await cluster.stop()

    try:
        asyncio.run(scenario())
    finally:
        ray.shutdown()
