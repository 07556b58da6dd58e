"""Top logprobs (OpenAI `top_logprobs`, vLLM `logprobs=k`): at every generated position the
k most likely tokens and their logprobs equal `transformers`' log-softmax over the same
weights, in one engine and when a prefill engine samples the first token and a decode
engine the rest."""

from __future__ import annotations

import pytest

from tandem.engine.config import EngineConfig, EngineMode
from tandem.engine.generate import generate
from tandem.engine.llm_engine import Engine
from tandem.engine.sampler import TopLogprobs
from tandem.engine.sampling_params import SamplingParams
from tests.helpers.hf_reference import LOGPROB_TOLERANCE, hf_top_logprobs
from tests.helpers.kv_budget import with_test_kv
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)

NUM_TOP = 5
PARAMS = SamplingParams(
    max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=NUM_TOP
)


def make_engine(model_dir, **overrides) -> Engine:
    config = EngineConfig(model=str(model_dir), max_model_len=256, **with_test_kv(overrides))
    return Engine(config)


def assert_matches(got: list[TopLogprobs], expected: list[tuple[list[int], list[float]]]) -> None:
    assert len(got) == len(expected)
    for position, (top, (ids, logprobs)) in enumerate(zip(got, expected, strict=True)):
        assert top.token_ids == ids, f"position {position}"
        assert top.logprobs == pytest.approx(logprobs, **LOGPROB_TOLERANCE), f"position {position}"


def test_top_logprobs_equal_transformers(tiny_model_dir):
    prompt = make_prompts(2048, (30,), seed=21)[0]
    engine = make_engine(tiny_model_dir)
    [out] = generate(engine, [prompt], PARAMS)
    assert_matches(
        out.top_logprobs, hf_top_logprobs(tiny_model_dir, prompt, out.token_ids, NUM_TOP)
    )
    # Greedy: each chosen token leads its position's list, with the same logprob.
    assert [top.token_ids[0] for top in out.top_logprobs] == out.token_ids
    assert [top.logprobs[0] for top in out.top_logprobs] == out.logprobs
    assert engine.is_idle()


def test_top_logprobs_across_a_kv_hand_off(tiny_model_dir):
    prompt = make_prompts(2048, (40,), seed=22)[0]
    prefill = make_engine(tiny_model_dir, mode=EngineMode.PREFILL_ONLY)
    decode = make_engine(tiny_model_dir, mode=EngineMode.DECODE_ONLY)
    prefill.add_request("r", prompt, PARAMS)
    [first] = prefill.step()
    decode.reserve_import("r", prompt, first.new_token_ids[0], PARAMS)
    decode.write_kv("r", prefill.export_kv("r").blocks)
    decode.commit_import("r")
    assert prefill.release("r")
    tops, token_ids = list(first.new_top_logprobs), list(first.new_token_ids)
    while decode.has_unfinished_requests():
        for out in decode.step():
            tops += out.new_top_logprobs
            token_ids += out.new_token_ids
    assert len(token_ids) == PARAMS.max_tokens
    assert_matches(tops, hf_top_logprobs(tiny_model_dir, prompt, token_ids, NUM_TOP))
    assert prefill.is_idle() and decode.is_idle()
