"""What the engine reports to its caller (workers, the offline `generate` helper)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.engine.request import FinishReason
from tandem.engine.sampler import TopLogprobs


@dataclass(frozen=True)
class CannotStart:
    """Why a constrained request ended before its first token: its grammar did not
    compile in time (`timed_out`: the engine is busy compiling; another try may do), or
    the grammar or the replay of its accepted tokens was refused."""

    reason: str
    timed_out: bool


@dataclass
class PromptLogprobs:
    """For each prompt position i: the logprob of prompt token i + 1 given tokens 0..i,
    that token's rank there (1 = the most likely; ties by token id) and, when asked
    (params.prompt_top_logprobs), the most likely tokens there."""

    logprobs: list[float]
    ranks: list[int]
    top: list[TopLogprobs] = field(default_factory=list)


@dataclass
class RequestOutput:
    """New tokens of one request from one engine step."""

    req_id: str
    # Tokens sampled this step (one per step today).
    new_token_ids: list[int]
    # log_softmax of the raw logits at each new token.
    new_logprobs: list[float]
    # Text released this step (never ends inside a UTF-8 character or a stop string).
    delta_text: str
    finished: bool
    # PREFILLED = KV held for a transfer (prefill-only engines); None while running.
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int
    # All tokens generated so far.
    num_output_tokens: int
    # With the first token of a locally prefilled request: seconds queued before the
    # first chunk ran, and from then to the first token (prefill compute, all chunks).
    queue_s: float | None = None
    prefill_s: float | None = None
    # With the first token, when params.prompt_logprobs.
    prompt_logprobs: PromptLogprobs | None = None
    # With STOP: the stop token id or stop string that ended it (None: EOS, a grammar).
    stop_reason: int | str | None = None
    # params.top_logprobs > 0: the most likely tokens at each new token's position.
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # With ABORT before any token: why its grammar could not start.
    cannot_start: CannotStart | None = None


@dataclass
class CompletionOutput:
    """A finished request, as `generate` returns it."""

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    # The stop token id or stop string that ended it (vLLM's stop_reason), else None.
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


@dataclass
class KvExport:
    """A prefilled request's KV, read out for a transfer (see `Engine.export_kv`)."""

    req_id: str
    # Prompt positions covered: blocks hold positions [0, num_tokens).
    num_tokens: int
    block_ids: list[int]
    # [layers, 2 (K, V), len(block_ids), block_size, kv_heads, head_dim]
    blocks: torch.Tensor


@dataclass
class EngineStats:
    """A snapshot for metrics, routing and leak checks."""

    num_waiting: int
    num_running: int
    # Prefilled requests whose KV is held for a transfer.
    num_held: int
    # Decode-side requests with blocks allocated and KV being written.
    num_importing: int
    num_free_blocks: int
    num_blocks: int
    # Prompt tokens not yet computed across waiting and running requests.
    num_queued_prefill_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_cached_blocks: int
