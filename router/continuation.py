"""What a migrated sequence continues with: the params of the rest, and the router's text.

After a migration the new pair prefills prompt + every token already streamed and
generates the rest. The router then detokenizes the output itself (replaying what was
sent), so text the old worker held back (a partial UTF-8 character, a possible stop
string) is not lost and stop strings spanning the switch are found.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.engine.detokenizer import IncrementalDetokenizer, hides_stop_token
from tandem.engine.request import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tandem.router.generation_chunk import GenerationChunk


def continuation_params(
    params: SamplingParams, streamed: list[int], router_stops: bool
) -> SamplingParams:
    """The sampling params of a continuation after the `streamed` tokens.

    With `router_stops`, stop strings are left to the router's detokenizer, which sees
    the whole output (the new worker would see only the part it generates). The streamed
    tokens end the new prompt; `num_resumed_tokens` tells the workers' penalties that
    they were generated. A grammar resumes with the streamed tokens accepted.
    """
    num_streamed = len(streamed)
    structured = params.structured
    return dataclasses.replace(
        params,
        max_tokens=params.max_tokens - num_streamed,
        min_tokens=max(0, params.min_tokens - num_streamed),
        stop=[] if router_stops else list(params.stop),
        num_resumed_tokens=params.num_resumed_tokens + num_streamed,
        prompt_logprobs=False,  # the client has them from the first attempt
        prompt_top_logprobs=0,
        structured=None if structured is None else structured.continued(streamed),
    )


def replay_detokenizer(
    tokenizer: Any, prompt_ids: list[int], params: SamplingParams, output_ids: list[int]
) -> IncrementalDetokenizer:
    """A detokenizer in the state the first worker's was after `output_ids` (the same
    algorithm on the same tokens releases the same text, so what it holds is what the
    client has not seen yet)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    for token_id in output_ids:
        detok.add_token(token_id)
    return detok


def redetokenize(chunk: GenerationChunk, detok: IncrementalDetokenizer) -> GenerationChunk:
    """The chunk with the router's text; cut (and finished) at a completed stop string.
    A last token that ended the sequence as a stop token adds no text (`hides_stop_token`)."""
    text = ""
    token_ids = chunk.token_ids
    if token_ids and hides_stop_token(chunk.finish_reason, chunk.stop_reason, detok.include_stop):
        token_ids = token_ids[:-1]
    for i, token_id in enumerate(token_ids):
        update = detok.add_token(token_id)
        text += update.delta_text
        if update.stop_string is not None:
            return dataclasses.replace(
                chunk,
                token_ids=chunk.token_ids[: i + 1],
                text=text,
                logprobs=chunk.logprobs[: i + 1],
                top_logprobs=chunk.top_logprobs[: i + 1],
                finish_reason=FinishReason.STOP,
                stop_reason=update.stop_string,
            )
    if chunk.finish_reason is not None:
        text += detok.flush()
        if detok.stop_string is not None:
            return dataclasses.replace(
                chunk, text=text, finish_reason=FinishReason.STOP, stop_reason=detok.stop_string
            )
    return dataclasses.replace(chunk, text=text)


def final_chunk(detok: IncrementalDetokenizer | None, reason: FinishReason) -> GenerationChunk:
    """A token-less last chunk (the finish message was lost with the worker)."""
    return GenerationChunk([], detok.flush() if detok is not None else "", [], reason)
