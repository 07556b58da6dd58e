"""Penalties and logit bias inside the engine: the disaggregated hand-off and a resumed
request (migration, KV recompute) choose exactly what one colocated run chooses."""

from __future__ import annotations

import dataclasses

import pytest

from tandem.engine.config import EngineConfig, EngineMode
from tandem.engine.generate import generate
from tandem.engine.llm_engine import Engine
from tandem.engine.sampling_params import SamplingParams
from tests.helpers.kv_budget import with_test_kv
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)

PENALTIES = {"presence_penalty": 0.7, "frequency_penalty": 0.9, "repetition_penalty": 1.4}


def make_engine(model_dir, **overrides) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model_dir), max_model_len=512, num_threads=1, **with_test_kv(overrides)
        )
    )


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    (out,) = generate(engine, [prompt], params)
    assert engine.is_idle()
    return out.token_ids


@pytest.fixture(scope="module")
def colocated(tiny_model_dir) -> Engine:
    return make_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return make_prompts(2048, (37,), seed=5)[0]


def test_penalties_change_greedy_output(colocated, prompt):
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain = run(colocated, prompt, greedy)
    penalised = run(colocated, prompt, dataclasses.replace(greedy, **PENALTIES))
    assert penalised != plain
    # The greedy run repeats tokens; the frequency-penalised one repeats fewer.
    assert len(set(penalised)) > len(set(plain))


def test_resumed_request_counts_resumed_tokens_as_generated(colocated, prompt):
    """Prompt + k tokens already sent, `num_resumed_tokens=k`: the continuation equals the
    uninterrupted run; counting those tokens as prompt instead changes it."""
    # No repetition penalty: it treats prompt and output alike and would hide the difference.
    params = SamplingParams(
        max_tokens=32, temperature=0.0, ignore_eos=True, presence_penalty=2, frequency_penalty=2
    )
    whole = run(colocated, prompt, params)
    k = 12
    rest = dataclasses.replace(params, max_tokens=32 - k)
    resumed = dataclasses.replace(rest, num_resumed_tokens=k)
    assert run(colocated, [*prompt, *whole[:k]], resumed) == whole[k:]
    assert run(colocated, [*prompt, *whole[:k]], rest) != whole[k:]


def test_prefill_to_decode_hand_off_equals_colocated(tiny_model_dir, colocated, prompt):
    bias = {t: -100.0 for t in run(colocated, prompt, SamplingParams(max_tokens=4, temperature=0))}
    params = SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, logit_bias=bias, **PENALTIES
    )
    expected = run(colocated, prompt, params)
    assert not set(expected) & set(bias)
    prefill = make_engine(tiny_model_dir, mode=EngineMode.PREFILL_ONLY)
    decode = make_engine(tiny_model_dir, mode=EngineMode.DECODE_ONLY)
    prefill.add_request("r", prompt, params)
    (first,) = prefill.step()
    assert decode.reserve_import("r", prompt, first.new_token_ids[0], params) is not None
    decode.write_kv("r", prefill.export_kv("r").blocks)
    decode.commit_import("r")
    assert prefill.release("r")
    tokens = list(first.new_token_ids)
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens += out.new_token_ids
    assert tokens == expected
    assert prefill.is_idle() and decode.is_idle()


def test_bias_on_a_token_outside_the_vocabulary_is_refused(colocated, prompt):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        colocated.add_request("bad", prompt, SamplingParams(logit_bias={2048: 1.0}))
    with pytest.raises(ValueError, match="num_resumed_tokens"):
        colocated.add_request("bad", prompt, SamplingParams(num_resumed_tokens=len(prompt)))
    assert colocated.is_idle()
