"""Prompt logprobs (OpenAI `echo` + `logprobs`, vLLM's `prompt_logprobs`): every prompt
position, chunked or not, equal to `transformers`' log-softmax over the same weights, and
each prompt token's rank there."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.engine.config import EngineConfig, EngineMode
from tandem.engine.llm_engine import Engine
from tandem.engine.outputs import PromptLogprobs
from tandem.engine.sampling_params import SamplingParams
from tests.helpers.hf_reference import LOGPROB_TOLERANCE, hf_top_logprobs
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)


def prompt_logprobs(engine: Engine, prompt: list[int]) -> PromptLogprobs:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True)
    engine.add_request("p", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (out,) = outputs
    engine.release("p")
    assert engine.is_idle()
    assert out.prompt_logprobs is not None
    return out.prompt_logprobs


def test_prompt_logprobs_equal_transformers_chunked_and_cached(tiny_model_dir):
    prompt = make_prompts(2048, (70,), seed=9)[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].float()
    expected = logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:]).unsqueeze(1))
    # 1 + the tokens more likely than the prompt's (no exact ties in float32 here).
    expected_ranks = (logits > logits.gather(1, torch.tensor(prompt[1:]).unsqueeze(1))).sum(1) + 1
    assert expected_ranks.max() > 1  # random weights: the prompt is not the model's choice
    # Chunks of 16 tokens, prefill-only (the prefill worker's engine); the second run
    # would hit the prefix cache, which prompt logprobs bypass.
    engine = Engine(
        EngineConfig(
            model=str(tiny_model_dir), max_model_len=256, max_num_batched_tokens=16, num_threads=1,
            mode=EngineMode.PREFILL_ONLY,
        )
    )  # fmt: skip
    for _ in range(2):
        got = prompt_logprobs(engine, prompt)
        assert len(got.logprobs) == len(prompt) - 1
        assert got.logprobs == pytest.approx(expected.squeeze(1).tolist(), **LOGPROB_TOLERANCE)
        assert got.ranks == expected_ranks.tolist()
        assert got.top == []  # no alternatives asked for


def test_prompt_top_logprobs_equal_transformers_across_chunks(tiny_model_dir):
    """With prompt_top_logprobs, each prompt position's k most likely tokens too (chunks
    of 16), whatever the generated tokens' own top_logprobs."""
    prompt = make_prompts(2048, (40,), seed=10)[0]
    expected = hf_top_logprobs(tiny_model_dir, prompt[:1], prompt[1:], 4)
    engine = Engine(
        EngineConfig(model=str(tiny_model_dir), max_model_len=256, max_num_batched_tokens=16,
                     num_threads=1)
    )  # fmt: skip
    params = SamplingParams(
        max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=2, prompt_logprobs=True,
        prompt_top_logprobs=4,
    )  # fmt: skip
    engine.add_request("p", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (out,) = outputs
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs.top) == len(prompt) - 1
    for top, rank, prompt_id, (ids, logprobs) in zip(
        out.prompt_logprobs.top, out.prompt_logprobs.ranks, prompt[1:], expected, strict=True
    ):
        assert top.token_ids == ids
        # A prompt token among the 4 most likely has its place there as its rank.
        assert (rank <= 4) == (prompt_id in ids)
        if rank <= 4:
            assert ids[rank - 1] == prompt_id
        assert top.logprobs == pytest.approx(logprobs, **LOGPROB_TOLERANCE)
    assert engine.is_idle()
