"""A request's state inside one engine, from `add_request` to its finish."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.engine.sampler import TopLogprobs, token_draw_seed
from tandem.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.structured.matcher import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)prefill
    RUNNING = "running"  # holds KV blocks, scheduled every step
    PREEMPTED = "preempted"  # blocks taken back; will be recomputed from its tokens
    FINISHED = "finished"  # done; blocks freed or handed to the KV transfer


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the caller
    # Prefill-only engines: the first token is sampled and the prompt's KV is held for
    # a transfer (see Engine.export_kv / Engine.release).
    PREFILLED = "prefilled"


@dataclass
class Request:
    """Tokens and progress of one sequence (the engine runs `n = 1` per request)."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # params.top_logprobs > 0: the alternatives at each sampled token (as output_logprobs).
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # Tokens whose KV is in the pool (prefix-cache hits + computed chunks).
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at the first admission.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # When the scheduler first gave the request a chunk (queueing ends there).
    first_scheduled_time: float | None = None
    finish_reason: FinishReason | None = None
    # With STOP: the stop token id or stop string that ended it (vLLM's stop_reason);
    # None for EOS and a finished grammar.
    stop_reason: int | str | None = None
    # Chained hashes of the request's full blocks, extended as blocks fill.
    block_hashes: list[bytes] = field(default_factory=list)
    # With params.prompt_logprobs: the logprob of prompt token i + 1 given tokens 0..i.
    prompt_logprobs: list[float] = field(default_factory=list)
    # ... its rank there (1 = the most likely; ties ranked by token id) ...
    prompt_ranks: list[int] = field(default_factory=list)
    # ... and with params.prompt_top_logprobs, the most likely tokens at those positions.
    prompt_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # Structured outputs: the request's grammar matcher (None = unconstrained).
    grammar: RequestGrammar | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_id(self, position: int) -> int:
        if position < len(self.prompt_token_ids):
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - len(self.prompt_token_ids)]

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens in positions [start, end) over prompt + output."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        head = self.prompt_token_ids[start:num_prompt] if start < num_prompt else []
        return head + self.output_token_ids[max(0, start - num_prompt) : end - num_prompt]

    @property
    def penalty_prompt_token_ids(self) -> list[int]:
        """The client's prompt: `prompt_token_ids` less the tokens an earlier attempt of
        this request generated (`params.num_resumed_tokens`, see `SamplingParams`)."""
        return self.prompt_token_ids[: self.num_prompt_tokens - self.params.num_resumed_tokens]

    @property
    def generated_token_ids(self) -> list[int]:
        """Every token generated for the request, resumed ones first (what the OpenAI
        presence and frequency penalties count)."""
        resumed = self.params.num_resumed_tokens
        if not resumed:
            return self.output_token_ids
        return self.prompt_token_ids[self.num_prompt_tokens - resumed :] + self.output_token_ids

    @property
    def draw_seed(self) -> int | None:
        """The seed of the draw for this request's next token (None: unseeded).

        A function of the request's seed and the token's index among all its generated
        tokens, resumed ones included, and of nothing else: the same draws whatever shares
        the batch and wherever the tokens are sampled (a prefill worker's first token, a
        decode worker after the KV hand-off, a worker the request migrated to)."""
        if self.params.seed is None:
            return None
        index = self.params.num_resumed_tokens + len(self.output_token_ids)
        return token_draw_seed(self.params.seed, index)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
