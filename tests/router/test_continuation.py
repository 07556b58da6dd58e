"""The router's text after a migration (router/continuation.py): the same text the
worker's engine would have streamed, stop tokens included."""

from __future__ import annotations

import pytest

from tandem.engine.request import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer_loader import load_tokenizer
from tandem.router.continuation import redetokenize, replay_detokenizer
from tandem.router.generation_chunk import GenerationChunk

pytestmark = pytest.mark.timeout(60)

PROMPT = [554, 73, 1097]  # "The cache"
OUTPUT = [1034, 1251, 87, 1291, 971]  # " block moves between two"


def text_of(tokenizer, params: SamplingParams, streamed: list[int], tokens: list[int]) -> str:
    """What the router's detokenizer releases for `tokens` after `streamed`, then flushes."""
    detok = replay_detokenizer(tokenizer, PROMPT, params, streamed)
    return "".join(detok.add_token(t).delta_text for t in tokens) + detok.flush()


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("stop_reason", [OUTPUT[4], None])  # a stop token id; EOS or a grammar
def test_a_stop_token_in_the_last_chunk_adds_no_text(tiny_model_dir, include_stop, stop_reason):
    tokenizer = load_tokenizer(tiny_model_dir)
    params = SamplingParams(max_tokens=8, include_stop_str_in_output=include_stop)
    streamed, chunk_ids = OUTPUT[:2], OUTPUT[2:]
    last = GenerationChunk(chunk_ids, "", finish_reason=FinishReason.STOP, stop_reason=stop_reason)
    out = redetokenize(last, replay_detokenizer(tokenizer, PROMPT, params, streamed))
    shown = chunk_ids if include_stop else chunk_ids[:-1]
    assert text_of(tokenizer, params, streamed, chunk_ids) != text_of(
        tokenizer, params, streamed, chunk_ids[:-1]
    )  # the stop token has text of its own
    assert out.token_ids == chunk_ids
    assert (out.text, out.finish_reason) == (
        text_of(tokenizer, params, streamed, shown),
        FinishReason.STOP,
    )


def test_a_length_end_keeps_the_last_token_text(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    params = SamplingParams(max_tokens=5)
    last = GenerationChunk(OUTPUT[2:], "", finish_reason=FinishReason.LENGTH)
    out = redetokenize(last, replay_detokenizer(tokenizer, PROMPT, params, OUTPUT[:2]))
    assert out.text == text_of(tokenizer, params, OUTPUT[:2], OUTPUT[2:])
