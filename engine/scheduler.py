"""Token-budget scheduler: which tokens of which requests run in the next step.

No phases: every step, running requests go first (a decode is 1 token; a request in
the middle of a chunked prefill gets its next chunk), then waiting requests are
admitted with prefill chunks until `max_num_batched_tokens` is spent. When blocks run
out, the lowest-priority running request (the latest admitted) is preempted and later
recomputed from its tokens. Modes only change what happens after the first token
(see `EngineMode`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from tandem.engine.config import EngineConfig, EngineMode
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import FinishReason, Request, RequestStatus
from tandem.engine.sampler import TopLogprobs

logger = logging.getLogger(__name__)


@dataclass
class ScheduledChunk:
    """`num_new_tokens` tokens of `request`, from position `request.num_computed_tokens`."""

    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last token (so a token is sampled)."""
        req = self.request
        return req.num_computed_tokens + self.num_new_tokens == req.num_tokens


@dataclass
class SchedulerOutput:
    """What one engine step computes."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Requests preempted while building this step (their KV was freed).
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SampledToken:
    """One token the model runner sampled for a request."""

    token_id: int
    logprob: float
    # The most likely tokens, when the request's params.top_logprobs asks for them.
    top_logprobs: TopLogprobs | None = None


class Scheduler:
    """Owns the waiting queue and the running batch of one engine."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.max_model_len = config.max_model_len
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.eos_token_ids = frozenset(config.model_config.eos_token_ids)
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Join the running batch with KV already in the pool (an imported request)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._chunk_len(req.num_tokens - req.num_computed_tokens, budget)
            if num_new == 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            out.chunks.append(ScheduledChunk(req, num_new))
            budget -= num_new
            i += 1
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _chunk_len(self, num_remaining: int, budget: int) -> int:
        if num_remaining <= budget:
            return num_remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            # Prompt logprobs need the logits of every prompt position: no cache hits.
            cached = [] if req.params.prompt_logprobs else self.kv.find_cached_prefix(req)
            num_cached_tokens = len(cached) * self.kv.block_size
            num_new = self._chunk_len(req.num_tokens - num_cached_tokens, budget)
            if num_new == 0 or not self.kv.allocate_slots(req, num_new, cached):
                break
            self.waiting.popleft()
            self.kv.record_prefix_lookup(req.num_tokens, num_cached_tokens)
            req.num_computed_tokens = num_cached_tokens
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_cached_tokens
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, num_new))
            budget -= num_new

    def _preempt(self, req: Request) -> None:
        logger.debug("preempting %s at %d tokens", req.req_id, req.num_tokens)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, SampledToken]) -> list[Request]:
        """Advance progress after a step; returns the requests that got a new token."""
        advanced = []
        for chunk in out.chunks:
            req = chunk.request
            req.num_computed_tokens += chunk.num_new_tokens
            self.kv.cache_full_blocks(req)
            token = sampled.get(req.req_id)
            if token is None:
                continue
            req.output_token_ids.append(token.token_id)
            req.output_logprobs.append(token.logprob)
            if token.top_logprobs is not None:
                req.output_top_logprobs.append(token.top_logprobs)
            advanced.append(req)
            reason = self._finish_reason(req)
            if reason is None and self.config.mode is EngineMode.PREFILL_ONLY:
                reason = FinishReason.PREFILLED
            if reason is not None:
                self.finish(req, reason)
        return advanced

    def _finish_reason(self, req: Request) -> FinishReason | None:
        """Whether the last token ends the request (a stop token id: noted as its
        stop_reason; EOS, which comes first, leaves none)."""
        params = req.params
        num_output = len(req.output_token_ids)
        last = req.output_token_ids[-1]
        if num_output >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return FinishReason.STOP
            if last in params.stop_token_ids:
                req.stop_reason = last
                return FinishReason.STOP
        if num_output >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a request. Its KV is freed, except after PREFILLED (the engine holds it)."""
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if reason is not FinishReason.PREFILLED:
            self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
