"""What a request's stream carries to the APIs: its chunks of new tokens, and its usage."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.outputs import PromptLogprobs
from tandem.engine.request import FinishReason
from tandem.engine.sampler import TopLogprobs


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass
class GenerationChunk:
    """New tokens of a request, in the order the client sees them."""

    token_ids: list[int]
    text: str
    logprobs: list[float] = field(default_factory=list)
    # STOP, LENGTH or ABORT on the last chunk; None before.
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    # Which of the request's `n` sequences (choices) the tokens belong to.
    index: int = 0
    # With the first token when asked (SamplingParams.prompt_logprobs).
    prompt_logprobs: PromptLogprobs | None = None
    # One per token when asked (SamplingParams.top_logprobs > 0): the most likely tokens
    # at its position.
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # With STOP: the stop token id or stop string that ended the sequence (vLLM's
    # stop_reason); None for EOS and a finished grammar.
    stop_reason: int | str | None = None


def public_finish_reason(reason: FinishReason | None) -> str | None:
    """The string the public APIs (OpenAI, KServe) put in `finish_reason`."""
    return None if reason is None else reason.value
