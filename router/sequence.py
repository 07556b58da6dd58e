"""One sequence of a request (a choice): what the flow knows and keeps about it.

A request with `n = 1` is one sequence; `n > 1` is n sequences from one prefill
(`forked_flow.py`). Each sequence is driven by the same flow (`sequence_flow.py`),
so each one migrates on its own when its worker fails.
"""

from __future__ import annotations

import dataclasses

from opentelemetry.trace import Span

from tandem.engine.sampling_params import SamplingParams
from tandem.router.generation_chunk import Usage
from tandem.router.metrics import RequestRecord
from tandem.router.policy import RequestSlo

_MAX_SEED = 2**64


@dataclasses.dataclass
class Sequence:
    """One sequence's identity, shared request state, and progress."""

    # The worker-side request id (sequence i > 0 of a forked request: `req#i`).
    req_id: str
    # Which of the request's n sequences (the chunks' `index`).
    index: int
    prompt_ids: list[int]
    # This sequence's params (its own seed when forked).
    params: SamplingParams
    slo: RequestSlo
    # The request's usage, record and span (shared by its sequences).
    usage: Usage
    record: RequestRecord
    span: Span
    # The policy key of the placement the current attempt runs under.
    placement_key: str
    # Whether this sequence owns that placement (frees it on migration and at its end);
    # a forked request's sequences share the request's first placement until they move.
    owns_placement: bool
    # The policy key of this sequence's own placement after a migration.
    migration_key: str
    # Tokens already sent to the client.
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_migrations: int = 0
    # Failed attempts whose worker's engine step raised while this sequence was in it.
    num_engine_step_failures: int = 0
    # Whether it once waited for a decode worker to move to (sequence_flow.py: once only).
    waited_for_decode_worker: bool = False

    @property
    def request_has_tokens(self) -> bool:
        """Whether its request sent the client tokens: this sequence's, or (n > 1) any
        other's (the usage counts the tokens the request flow passed on)."""
        return bool(self.output_ids) or self.usage.completion_tokens > 0

    @property
    def first_attempt(self) -> bool:
        return self.num_migrations == 0

    @property
    def reports_cached_tokens(self) -> bool:
        """Whether this attempt's prefill sets `usage.cached_prompt_tokens` (the
        request's first prefill only)."""
        return self.index == 0 and self.first_attempt


def sequence_id(req_id: str, index: int) -> str:
    """The worker-side request id of sequence `index` (0 keeps the request's own)."""
    return req_id if index == 0 else f"{req_id}#{index}"


def sequence_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index`'s params: its own seed; prompt logprobs only from sequence 0."""
    if index == 0:
        return params
    seed = None if params.seed is None else (params.seed + index) % _MAX_SEED
    return dataclasses.replace(params, seed=seed, prompt_logprobs=False, prompt_top_logprobs=0)
