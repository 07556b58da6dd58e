"""Greedy output of the engine equals `transformers` token for token.

Eight prompts of 1 to 700 tokens go in together, under each scheduling regime the
engine has (chunked prefill, whole prefill, prefix-cache hits, preemption), and for
model variants (tied embeddings, QKV bias, llama3 RoPE scaling), with the `torch` and
the `cpu` attention backends.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tandem.engine.config import EngineConfig
from tandem.engine.generate import generate
from tandem.engine.llm_engine import Engine
from tandem.engine.sampling_params import SamplingParams
from tests.helpers.hf_reference import hf_greedy, save_random_model
from tests.helpers.kv_budget import with_test_kv
from tests.helpers.prompts import PROMPT_LENS, make_prompts

MAX_NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)

pytestmark = pytest.mark.timeout(600)


def run_engine(model_dir: Path, prompts: list[list[int]], **overrides) -> tuple[Engine, list]:
    config = EngineConfig(model=str(model_dir), max_model_len=1024, **with_test_kv(overrides))
    engine = Engine(config)
    outputs = generate(engine, prompts, GREEDY)
    return engine, outputs


def assert_token_equal(outputs, expected: list[list[int]]) -> None:
    for i, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        assert out.token_ids == ref, f"prompt {i} ({len(out.prompt_token_ids)} tokens) diverged"
    # Equality means little if the model just repeats one token.
    distinct = {t for ref in expected for t in ref}
    assert len(distinct) >= 2 * len(expected), f"degenerate reference output: {len(distinct)} ids"


def assert_idle(engine: Engine) -> None:
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks, stats
    assert engine.is_idle(), stats


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:
    vocab = EngineConfig(model=str(tiny_model_dir)).model_config.vocab_size
    return make_prompts(vocab)


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path, prompts) -> list[list[int]]:
    return hf_greedy(tiny_model_dir, prompts, MAX_NEW_TOKENS)


# Every test runs both CPU backends: `torch` (the reference: F.linear, the Python model,
# gathered attention) and `cpu` (what `auto` picks on CPU: the C++ ops, the packed
# matmul and the one-call decoder stack). Triton runs under its interpreter in
# test_triton_equivalence.py.
BACKENDS = pytest.mark.parametrize("backend", ["torch", "cpu"])


@BACKENDS
def test_chunked_prefill_matches_transformers(tiny_model_dir, prompts, expected, backend):
    assert max(PROMPT_LENS) > 128
    engine, outputs = run_engine(
        tiny_model_dir, prompts, max_num_batched_tokens=128, attention_backend=backend
    )
    assert engine.config.resolved_attention_backend == backend
    assert_token_equal(outputs, expected)
    assert_idle(engine)


@BACKENDS
def test_whole_prefill_matches_transformers(tiny_model_dir, prompts, expected, backend):
    engine, outputs = run_engine(
        tiny_model_dir,
        prompts,
        enable_chunked_prefill=False,
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,
        attention_backend=backend,
    )
    assert_token_equal(outputs, expected)
    assert engine.stats().prefix_cache_hits == 0
    assert_idle(engine)


@BACKENDS
def test_prefix_cache_hits_match_transformers(tiny_model_dir, prompts, expected, backend):
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=1024, attention_backend=backend)
    engine = Engine(config)
    assert_token_equal(generate(engine, prompts, GREEDY, req_id_prefix="wave1"), expected)
    # Second wave: long shared prefixes of the first wave's prompts, new suffixes.
    suffixes = make_prompts(config.model_config.vocab_size, (9, 40, 3, 77), seed=1)
    wave2 = [
        prompts[i][:keep] + s[1:]
        for i, keep, s in zip((7, 6, 5, 4), (650, 500, 300, 64), suffixes, strict=True)
    ]
    outputs = generate(engine, wave2, GREEDY, req_id_prefix="wave2")
    assert_token_equal(outputs, hf_greedy(tiny_model_dir, wave2, MAX_NEW_TOKENS))
    assert engine.stats().prefix_cache_hits > 0
    assert all(out.num_cached_tokens >= 64 for out in outputs), [
        o.num_cached_tokens for o in outputs
    ]
    assert_idle(engine)


@BACKENDS
def test_preemption_matches_transformers(tiny_model_dir, prompts, expected, backend):
    # 64 blocks of 16 tokens hold the longest request alone but not the whole batch.
    engine, outputs = run_engine(tiny_model_dir, prompts, num_blocks=64, attention_backend=backend)
    assert_token_equal(outputs, expected)
    assert engine.stats().num_preemptions > 0
    assert_idle(engine)


def _small_dims() -> dict:
    return dict(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=320,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    )


@BACKENDS
def test_qkv_bias_model_matches_transformers(tiny_model_dir, tmp_path, prompts, backend):
    config = Qwen2Config(**_small_dims(), tie_word_embeddings=False, rope_theta=1e6)
    model_dir = save_random_model(Qwen2ForCausalLM, config, tmp_path / "qwen2", tiny_model_dir)
    engine, outputs = run_engine(
        model_dir, prompts, max_num_batched_tokens=256, attention_backend=backend
    )
    assert engine.model_config.qkv_bias
    assert_token_equal(outputs, hf_greedy(model_dir, prompts, MAX_NEW_TOKENS))
    assert_idle(engine)


@BACKENDS
def test_llama3_rope_scaling_matches_transformers(tiny_model_dir, tmp_path, prompts, backend):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    config = LlamaConfig(**_small_dims(), rope_scaling=rope, rope_theta=500000.0)
    model_dir = save_random_model(LlamaForCausalLM, config, tmp_path / "llama3", tiny_model_dir)
    engine, outputs = run_engine(
        model_dir, prompts, max_num_batched_tokens=256, attention_backend=backend
    )
    assert engine.model_config.rope_parameters["rope_type"] == "llama3"
    assert_token_equal(outputs, hf_greedy(model_dir, prompts, MAX_NEW_TOKENS))
    assert_idle(engine)
