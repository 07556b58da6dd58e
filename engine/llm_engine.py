"""The engine: `add_request` / `step` / `abort`, plus the KV hand-off of disaggregation.

`step()` = schedule → run the model → update requests → detokenize. The engine is
synchronous and single-threaded; workers drive it from one thread and feed it
through a queue. KV hand-off (the narrow interface `kv_transfer` builds on):

* prefill side (`EngineMode.PREFILL_ONLY`): a request finishes with reason
  `FinishReason.PREFILLED` after its first token; its blocks stay held under a lease
  until `release` (or expiry, checked every step). While held, a transfer thread may
  send them straight from the cache: `acquire_held_kv` pins them (`engine.kv_pins`)
  until the thread unpins. Released blocks remain in the prefix cache.
* decode side (`EngineMode.DECODE_ONLY`): `reserve_import` allocates blocks for a
  prompt (None = not now) and puts the request in a receiving state that no step
  reads; `acquire_import_kv` hands a transfer thread a pinned write view of them (or
  the engine thread fills them with `write_kv`); `commit_import` joins the running batch
  with the first token already sampled; `cancel_import` frees them on failure (after
  the writer unpins). `add_request` works only with `local_prefill=True`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.engine.block_pool import BlockPool
from tandem.engine.config import EngineConfig, EngineMode
from tandem.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer, hides_stop_token
from tandem.engine.host_memory import keep_freed_memory
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.kv_pins import KvPins, PinnedBlocks
from tandem.engine.model.loader import load_model
from tandem.engine.model_runner import ModelRunner
from tandem.engine.outputs import (
    CannotStart,
    EngineStats,
    KvExport,
    PromptLogprobs,
    RequestOutput,
)
from tandem.engine.request import FinishReason, Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import Scheduler
from tandem.engine.structured.runtime import StructuredRuntime
from tandem.engine.tokenizer_loader import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _HeldKv:
    request: Request
    expires_at: float


class Engine:
    """One model replica with its paged KV cache."""

    def __init__(
        self, config: EngineConfig, tokenizer=None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        if torch.device(config.device).type == "cpu":
            keep_freed_memory()  # process-wide: steps reuse freed activations (host_memory.py)
        self.config = config
        self.max_model_len = config.max_model_len
        self.model_config = config.model_config
        # Times KV leases (injectable, so a test can expire one without waiting).
        self.clock = clock
        if tokenizer is None:
            tokenizer = load_tokenizer(config.model)
        self.tokenizer = tokenizer
        model = load_model(
            config.model,
            config.model_config,
            config.torch_dtype,
            torch.device(config.device),
            self.max_model_len,
            attention_backend=config.attention_backend,
        )
        self.pool = BlockPool(config.num_blocks)
        self.kv = KVCacheManager(self.pool, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv)
        self.runner = ModelRunner(config, model, self.kv)
        # The only engine state KV transfer threads touch (thread-safe).
        self.kv_pins = KvPins(self.runner.kv_caches)
        self._requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._held: dict[str, _HeldKv] = {}
        self._importing: dict[str, Request] = {}
        # Grammar-constrained requests: compile wait, matchers (see engine/structured/).
        self.structured = StructuredRuntime(
            tokenizer, config.model_config.vocab_size, list(config.model_config.eos_token_ids),
            clock,
        )  # fmt: skip

    # ----- requests -------------------------------------------------------------

    def add_request(
        self,
        req_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        local_prefill: bool = False,
    ) -> Request:
        """Queue a request; raises ValueError on bad input (nothing is kept then).

        A decode-only engine prefills a prompt only with `local_prefill=True` (the caller
        chose conditional disaggregation or recovers a failed pull); its normal entry is
        `reserve_import` + `commit_import`."""
        if self.config.mode is EngineMode.DECODE_ONLY and not local_prefill:
            raise ValueError(
                "a decode-only engine admits imported KV; it prefills a prompt only when "
                "asked to (local_prefill)"
            )
        prompt_ids = self._prompt_ids(prompt)
        request = self._new_request(req_id, prompt_ids, params)
        if params.structured is not None:
            self.structured.start(request, [], self.scheduler.add)
        else:
            self.scheduler.add(request)
        self._requests[req_id] = request
        self._detokenizers[req_id] = IncrementalDetokenizer(self.tokenizer, prompt_ids, params)
        return request

    def abort(self, req_id: str) -> bool:
        """Stop a request wherever it is and free what it holds; False if unknown."""
        if req_id in self._held:
            self.release(req_id)
            return True
        if req_id in self._importing:
            self.cancel_import(req_id)
            return True
        request = self._requests.pop(req_id, None)
        if request is None:
            return False
        self._detokenizers.pop(req_id, None)
        self.structured.discard(req_id)
        self.scheduler.finish(request, FinishReason.ABORT)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns the requests that produced a token."""
        self.expire_leases(self.clock())
        outputs = self._poll_grammars()
        out = self.scheduler.schedule()
        if out.is_empty:
            if self.structured.num_waiting:
                self.structured.wait()
            return outputs
        sampled = self.runner.execute(out)
        refused = self.structured.advance(out.chunks, sampled)
        for request in self.scheduler.update(out, sampled):
            self._end_grammar(request, refused)
            outputs.append(self._emit(request))
        return outputs

    # ----- structured outputs ----------------------------------------------------

    def _poll_grammars(self) -> list[RequestOutput]:
        """Start requests whose grammar compiled; end (abort) those that cannot start."""
        if not self.structured.num_waiting:
            return []
        outputs = []
        for request, failure in self.structured.poll():
            logger.warning("request %s cannot start: %s", request.req_id, failure.reason)
            self.scheduler.finish(request, FinishReason.ABORT)
            outputs.append(self._emit_ended(request, cannot_start=failure))
        return outputs

    def _end_grammar(self, request: Request, refused: set[str]) -> None:
        """A finished grammar ends its request with `stop` (even past `ignore_eos`, and on
        a prefill worker: nothing is left to decode, so the KV is not held)."""
        grammar = request.grammar
        if grammar is None:
            return
        if request.req_id in refused:
            if not request.is_finished:
                self.scheduler.finish(request, FinishReason.ABORT)
            return
        if grammar.is_terminated:
            self._stop(request)

    def _stop(self, request: Request) -> None:
        """End a request with `stop` (a finished grammar, a completed stop string). One a
        prefill worker just prefilled ends too: nothing is left to decode, so its KV is
        freed, not held for a decode worker. One the same token ended by length stops
        too: its text ends at the stop string (OpenAI: `stop` is a natural stop point or
        a provided stop sequence)."""
        if request.finish_reason is FinishReason.PREFILLED:
            self.kv.free(request)
            request.finish_reason = FinishReason.STOP
        elif request.finish_reason is FinishReason.LENGTH:
            request.finish_reason = FinishReason.STOP
        elif not request.is_finished:
            self.scheduler.finish(request, FinishReason.STOP)

    def _emit_ended(
        self, request: Request, cannot_start: CannotStart | None = None
    ) -> RequestOutput:
        """The last output of a request that ends without a new token (`cannot_start`:
        its grammar could not start)."""
        del self._requests[request.req_id]
        self._detokenizers.pop(request.req_id, None)
        return RequestOutput(
            req_id=request.req_id,
            new_token_ids=[],
            new_logprobs=[],
            delta_text="",
            finished=True,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(request.output_token_ids),
            cannot_start=cannot_start,
        )

    def _emit(self, request: Request) -> RequestOutput:
        req_id = request.req_id
        detok = self._detokenizers[req_id]
        if hides_stop_token(request.finish_reason, request.stop_reason, detok.include_stop):
            update = DetokenizerUpdate(delta_text="", stop_string=None)
        else:
            update = detok.add_token(request.output_token_ids[-1])
        delta = update.delta_text
        if update.stop_string is not None:
            request.stop_reason = update.stop_string
            self._stop(request)
        reason = request.finish_reason
        if request.is_finished:
            if update.stop_string is None and reason is not FinishReason.PREFILLED:
                delta += detok.flush()
            del self._requests[req_id]
            del self._detokenizers[req_id]
            if reason is FinishReason.PREFILLED:
                self._held[req_id] = _HeldKv(request, self.clock() + self.config.kv_lease_s)
                self.kv_pins.open(req_id, self.kv.block_ids[req_id])
        queue_s = prefill_s = None
        prompt_logprobs = None
        if len(request.output_token_ids) == 1 and request.first_scheduled_time is not None:
            queue_s = request.first_scheduled_time - request.arrival_time
            prefill_s = time.monotonic() - request.first_scheduled_time
            if request.params.prompt_logprobs:
                prompt_logprobs = PromptLogprobs(
                    list(request.prompt_logprobs),
                    list(request.prompt_ranks),
                    list(request.prompt_top_logprobs),
                )
        return RequestOutput(
            req_id=req_id,
            new_token_ids=request.output_token_ids[-1:],
            new_logprobs=request.output_logprobs[-1:],
            new_top_logprobs=request.output_top_logprobs[-1:],
            delta_text=delta,
            finished=request.is_finished,
            finish_reason=reason,
            stop_reason=request.stop_reason if request.is_finished else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(request.output_token_ids),
            queue_s=queue_s,
            prefill_s=prefill_s,
            prompt_logprobs=prompt_logprobs,
        )

    # ----- prefill side of the KV hand-off -------------------------------------

    def export_kv(self, req_id: str) -> KvExport:
        """Copy out a prefilled request's prompt KV (blocks stay pinned until release)."""
        held = self._held.get(req_id)
        if held is None:
            raise KeyError(f"no prefilled KV held for request {req_id!r}")
        block_ids = list(self.kv.block_ids[req_id])
        return KvExport(
            req_id=req_id,
            num_tokens=held.request.num_prompt_tokens,
            block_ids=block_ids,
            blocks=self.runner.read_kv_blocks(block_ids),
        )

    def held_block_ids(self, req_id: str) -> list[int]:
        """The held blocks of a prefilled request (what its KvHandle names)."""
        if req_id not in self._held:
            raise KeyError(f"no prefilled KV held for request {req_id!r}")
        return list(self.kv.block_ids[req_id])

    def acquire_held_kv(self, req_id: str) -> PinnedBlocks:
        """Pin a held request's blocks for a send straight from the cache. Thread-safe
        (a transfer thread calls it, not the engine's); KeyError once released or
        unknown. The caller must `unpin()` when the send ends, however it ends."""
        return self.kv_pins.acquire(req_id)

    def release(self, req_id: str) -> bool:
        """Unhold a prefilled request's blocks (they stay in the prefix cache); blocks a
        transfer still sends are freed once it unpins them (`expire_leases`)."""
        held = self._held.pop(req_id, None)
        if held is None:
            return False
        self._retire(req_id)
        return True

    def expire_leases(self, now: float) -> list[str]:
        """Release every held KV whose lease ran out by `now` (on `self.clock`) and free
        blocks whose last transfer pin is gone; returns the expired request ids."""
        self.kv_pins.collect()
        expired = [r for r, h in self._held.items() if h.expires_at <= now]
        for req_id in expired:
            logger.warning("KV lease of %s expired unpulled; freeing its blocks", req_id)
            self.release(req_id)
        return expired

    def _retire(self, req_id: str) -> None:
        """Free a held or importing request's blocks now, or after its transfer unpins."""
        blocks = self.kv.take_blocks(req_id)
        if not self.kv_pins.retire(req_id, lambda: self.pool.free(blocks)):
            logger.info("KV of %s still in transfer; its blocks are freed when it ends", req_id)

    # ----- decode side of the KV hand-off --------------------------------------

    def reserve_import(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        params: SamplingParams,
    ) -> list[int] | None:
        """Allocate blocks for a remote prefill's KV (`first_token_id`: the token the
        prefill side sampled); None when the pool is too full now."""
        prompt_ids = self._prompt_ids(prompt_token_ids)
        self._check_token_ids([first_token_id])
        request = self._new_request(req_id, prompt_ids, params)
        if not self.kv.allocate_slots(request, len(prompt_ids)):
            return None
        request.output_token_ids.append(first_token_id)
        self._importing[req_id] = request
        self.kv_pins.open(req_id, self.kv.block_ids[req_id])
        return list(self.kv.block_ids[req_id])

    def acquire_import_kv(self, req_id: str) -> PinnedBlocks:
        """A pinned write view of a reserved request's blocks, for a transfer thread to
        receive into in place. Thread-safe; KeyError unless the request is receiving.
        The writer must `unpin()` when it stops writing, before `commit_import`."""
        return self.kv_pins.acquire(req_id)

    def write_kv(self, req_id: str, blocks: torch.Tensor) -> None:
        """Fill a reserved request's blocks with KV read by the prefill side's `export_kv`
        (on the engine thread; a copy, where `acquire_import_kv` receives in place)."""
        if req_id not in self._importing:
            raise KeyError(f"no import reserved for request {req_id!r}")
        self.runner.write_kv_blocks(self.kv.block_ids[req_id], blocks)

    def commit_import(self, req_id: str) -> None:
        """The KV is in place: join the running batch (decoding from the first token).
        RuntimeError while a transfer thread still holds the write view."""
        if req_id not in self._importing:
            raise KeyError(f"no import reserved for request {req_id!r}")
        self.kv_pins.close(req_id)
        request = self._importing.pop(req_id)
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.params)
        request.num_computed_tokens = request.num_prompt_tokens
        # The prefill side already streamed the first token's text.
        detok.add_token(request.output_token_ids[0])
        self.kv.cache_full_blocks(request)
        if request.params.structured is not None:
            # The grammar resumes after the first token (sampled under it by the prefill
            # side); a token it refuses raises here and the import is undone.
            try:
                self.structured.start(
                    request, request.output_token_ids[:1], self.scheduler.add_running
                )
            except ValueError:
                self._retire(req_id)
                request.status = RequestStatus.FINISHED
                raise
        else:
            self.scheduler.add_running(request)
        self._requests[req_id] = request
        self._detokenizers[req_id] = detok

    def cancel_import(self, req_id: str) -> bool:
        request = self._importing.pop(req_id, None)
        if request is None:
            return False
        self._retire(req_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = FinishReason.ABORT
        return True

    # ----- introspection --------------------------------------------------------

    def stats(self) -> EngineStats:
        sched = self.scheduler
        queued = sum(
            max(0, r.num_prompt_tokens - r.num_computed_tokens)
            for r in (*sched.waiting, *sched.running)
        )
        return EngineStats(
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            num_held=len(self._held),
            num_importing=len(self._importing),
            num_free_blocks=self.pool.num_free_blocks,
            num_blocks=self.pool.num_blocks,
            num_queued_prefill_tokens=queued,
            prefix_cache_queries=self.kv.num_prefix_queries,
            prefix_cache_hits=self.kv.num_prefix_hits,
            num_preemptions=sched.num_preemptions,
            num_cached_blocks=self.pool.num_cached_blocks,
        )

    def close(self) -> None:
        """Stop the engine's helper threads (grammar compilation); the owner (the engine
        loop's thread, as it leaves) calls it once no step will run again."""
        self.structured.close()

    def is_idle(self) -> bool:
        """No request, hold or import left, and every block free."""
        return (
            not self._requests
            and not self._held
            and not self._importing
            and self.pool.num_free_blocks == self.pool.num_blocks
        )

    # ----- validation -----------------------------------------------------------

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return list(self.tokenizer.encode(prompt))
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must hold at least one token")
        self._check_token_ids(ids)
        return ids

    def _check_token_ids(self, ids: list[int]) -> None:
        vocab = self.model_config.vocab_size
        for token_id in ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise ValueError(f"token ids must be ints, got {token_id!r}")
            if not 0 <= token_id < vocab:
                raise ValueError(f"token id {token_id} is outside the vocabulary [0, {vocab})")

    def _new_request(self, req_id: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        if not isinstance(req_id, str) or not req_id:
            raise ValueError(f"req_id must be a non-empty string, got {req_id!r}")
        if req_id in self._requests or req_id in self._held or req_id in self._importing:
            raise ValueError(f"request id {req_id!r} is already in use")
        max_len = self.max_model_len
        if len(prompt_ids) >= max_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {max_len} "
                "(prompt + at least one output token)"
            )
        if params.num_resumed_tokens >= len(prompt_ids):
            raise ValueError(
                f"num_resumed_tokens ({params.num_resumed_tokens}) must leave at least one "
                f"client prompt token of the {len(prompt_ids)}"
            )
        if params.logit_bias:
            self._check_token_ids(list(params.logit_bias))
        if params.allowed_token_ids:
            self._check_token_ids(params.allowed_token_ids)
        for sequence in params.bad_words_token_ids:
            self._check_token_ids(sequence)
        needed = self.config.blocks_for(min(len(prompt_ids) + params.max_tokens, max_len))
        if needed > self.pool.num_blocks:
            raise ValueError(
                f"request needs {needed} KV blocks but the pool has {self.pool.num_blocks}"
            )
        return Request(req_id, prompt_ids, params)
