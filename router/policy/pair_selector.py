"""Pair selection (request-flow step 3): which prefill worker, which decode worker.

For a prompt of `n` tokens and `max_tokens` to generate:

- **Prefill score** of worker `p` = predicted queue wait on `p` + predicted time to
  prefill the tokens `p` does not have cached (`n - p.prefix.match_len(prompt)`).
  The lowest score wins, except that prefix affinity may not overload a worker: only
  workers whose wait is within `affinity_max_wait_ratio × least wait +
  affinity_min_wait_gap_s` are eligible. A hot prefix thus spills onto a second
  worker (which caches it too) instead of piling onto one. Near-ties go to the worker
  with the smaller cached set, which spreads new prefixes across workers.
- **Decode choice**: among workers with `prompt + max_tokens` worth of free KV blocks,
  the one with the lowest predicted step time after admitting the request (the
  request's ITL), preferring those within the request's ITL target; without prefill
  workers (colocated), the shortest prefill queue first.
- **Conditional disaggregation**: the decode worker may prefill the prompt itself
  (`prefill_worker_id=None`) when its uncached part is at most
  `max_local_prefill_tokens`, the prefill stall it adds to the running batch's steps
  keeps every running request within its ITL target, and it predicts an earlier
  *second* token than the disaggregated pair (which pays the KV transfer). When the
  stall would break that guard but the disaggregated pair would miss the request's TTFT
  target (a busy prefill pool) while a local prefill answers sooner, the request is
  prefilled locally anyway: one slow step for the batch, instead of a missed SLO. Without
  available prefill workers, local prefill is the only option.

The selector is pure: it reads `WorkerState`s (and the clock, for a 503's Retry-After
during a restart hold) and returns a `Placement`; committing the placement (accounting,
prefix index) is the caller's job (`GoodputPolicy`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from tandem.router.errors import WorkerUnavailable
from tandem.router.policy.prefix_tree import block_hashes
from tandem.router.policy.slo import RequestSlo
from tandem.router.policy.worker_state import WorkerState
from tandem.worker.config import WorkerRole

Decision = Literal["disaggregated", "local_prefill"]
DISAGGREGATED: Decision = "disaggregated"
LOCAL_PREFILL: Decision = "local_prefill"


# Retry-After of the 503 a request gets at once while no decode worker serves (a
# replacement takes seconds to start, so an earlier retry would fail the same way); plus
# what is left of the decode role's restart backoff, when its next start is held back.
NO_WORKER_RETRY_AFTER_S = 2.0

# Conditional disaggregation's default bound on a decode worker's own prefills.
DEFAULT_MAX_LOCAL_PREFILL_TOKENS = 512


@dataclass(frozen=True)
class SelectorConfig:
    # Affinity may choose a worker whose queue wait is at most this many times the
    # least-loaded worker's wait, plus `affinity_min_wait_gap_s`.
    affinity_max_wait_ratio: float = 2.0
    affinity_min_wait_gap_s: float = 0.05
    # Prefill scores within this many seconds of the best count as a tie.
    score_tie_s: float = 1e-3
    enable_local_prefill: bool = True
    # Longest uncached prompt a decode worker may prefill itself (bounds the stall).
    max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS
    # Prefill chunk a decode worker interleaves with its decode steps.
    local_prefill_chunk_tokens: int = 512
    # Predicted KV transfer cost per prompt token (delays the second token only).
    kv_transfer_s_per_token: float = 2e-6

    def __post_init__(self) -> None:
        if self.affinity_max_wait_ratio < 1:
            raise ValueError(
                f"affinity_max_wait_ratio must be >= 1, got {self.affinity_max_wait_ratio}"
            )
        for name in ("affinity_min_wait_gap_s", "score_tie_s", "kv_transfer_s_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_local_prefill_tokens", "local_prefill_chunk_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Placement:
    """Where a request runs and what the policy predicts for it."""

    # None: the decode worker prefills locally.
    prefill_worker_id: str | None
    decode_worker_id: str
    # "disaggregated" or "local_prefill"; labels `tandem:disagg_decisions_total`.
    decision: Decision
    # Queue wait before the prompt starts prefilling (on whichever worker prefills it).
    predicted_queue_s: float
    # Queue wait + uncached prefill time.
    predicted_ttft_s: float
    # Decode step time after the request joins the batch.
    predicted_itl_s: float
    num_prompt_tokens: int
    # Prompt tokens predicted to hit the prefix cache where the prompt is prefilled.
    num_cached_tokens: int
    # KV blocks the decode worker must hold for prompt + max_tokens.
    num_decode_blocks: int
    # The decode worker has those blocks free now (else admission must wait or shed).
    fits: bool
    # The load guard overrode the best-affinity prefill worker.
    affinity_overridden: bool = False
    # Chained block hashes of the prompt, reused when the placement is committed.
    prompt_hashes: tuple[bytes, ...] = field(default=(), repr=False, compare=False)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens predicted to be computed."""
        return self.num_prompt_tokens - self.num_cached_tokens


@dataclass(frozen=True)
class _PrefillOption:
    worker: WorkerState
    wait_s: float
    cached: int
    ttft_s: float


class PairSelector:
    """Scores the available workers for one request; see the module docstring."""

    def __init__(
        self,
        prefill: Sequence[WorkerState],
        decode: Sequence[WorkerState],
        config: SelectorConfig | None = None,
    ) -> None:
        if not decode:
            raise ValueError("decode must name at least one decode or colocated worker")
        sizes = {w.block_size for w in (*prefill, *decode)}
        if len(sizes) != 1:
            raise ValueError(f"all workers must share one block size, got {sorted(sizes)}")
        self.prefill = list(prefill)
        self.decode = list(decode)
        self.config = config or SelectorConfig()
        self.block_size = sizes.pop()
        # When the next decode-capable worker may start, on the wall clock (its role's
        # restart backoff, from the membership; 0: not held).
        self.decode_start_held_until_unix_s = 0.0

    def add_worker(self, worker: WorkerState) -> None:
        """A worker joined the pools (membership changed while serving)."""
        if worker.block_size != self.block_size:
            raise ValueError(
                f"worker {worker.worker_id} has block size {worker.block_size}, "
                f"the pools use {self.block_size}"
            )
        pool = self.prefill if worker.role is WorkerRole.PREFILL else self.decode
        if any(w.worker_id == worker.worker_id for w in pool):
            raise ValueError(f"worker {worker.worker_id} is already in the pools")
        pool.append(worker)

    def remove_worker(self, worker_id: str) -> None:
        """A worker left the pools: never selected again (no-op if unknown)."""
        self.prefill = [w for w in self.prefill if w.worker_id != worker_id]
        self.decode = [w for w in self.decode if w.worker_id != worker_id]

    def select(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int,
        slo: RequestSlo,
        cache_salt: str | None = None,
    ) -> Placement:
        """The best pair for this request now; raises `WorkerUnavailable` (503 /
        UNAVAILABLE to the client) when no decode worker is up. `cache_salt`: the
        request's, which its prompt's block hashes chain from (as on the workers)."""
        cfg = self.config
        n = len(prompt_ids)
        hashes = block_hashes(prompt_ids, self.block_size, cache_salt)
        need = -(-(n + max_tokens) // self.block_size)
        decode = self._pick_decode(n, need, slo)
        itl = decode.predicted_step_s(1, n)
        fits = _fits(decode, need)
        remote, overridden = self._pick_prefill(hashes, n)

        local_ttft = math.inf
        local_cached = 0
        remote_second = math.inf
        if remote is not None:
            remote_second = remote.ttft_s + cfg.kv_transfer_s_per_token * n
        if cfg.enable_local_prefill or remote is None:
            local_cached = decode.prefix.match_blocks(hashes, n) * self.block_size
            uncached = n - local_cached
            local_ttft = self._local_ttft(decode, uncached, slo, forced=remote is None)
            if math.isinf(local_ttft):
                local_ttft = self._rescue_ttft(decode, uncached, slo, remote_second)
        if remote is not None and not local_ttft <= remote_second:
            return Placement(
                prefill_worker_id=remote.worker.worker_id,
                decode_worker_id=decode.worker_id,
                decision=DISAGGREGATED,
                predicted_queue_s=remote.wait_s,
                predicted_ttft_s=remote.ttft_s,
                predicted_itl_s=itl,
                num_prompt_tokens=n,
                num_cached_tokens=remote.cached,
                num_decode_blocks=need,
                fits=fits,
                affinity_overridden=overridden,
                prompt_hashes=tuple(hashes),
            )
        return Placement(
            prefill_worker_id=None,
            decode_worker_id=decode.worker_id,
            decision=LOCAL_PREFILL,
            predicted_queue_s=decode.predicted_queue_s(),
            predicted_ttft_s=local_ttft,
            predicted_itl_s=itl,
            num_prompt_tokens=n,
            num_cached_tokens=local_cached,
            num_decode_blocks=need,
            fits=fits,
            prompt_hashes=tuple(hashes),
        )

    # ----- decode side ---------------------------------------------------------------

    def _pick_decode(self, n: int, need: int, slo: RequestSlo) -> WorkerState:
        workers = [w for w in self.decode if w.available]
        if not workers:
            held_s = max(0.0, self.decode_start_held_until_unix_s - time.time())
            why = (
                f"; new decode workers keep dying young, the next starts in {held_s:.0f} s"
                if held_s > 0
                else ""
            )
            raise WorkerUnavailable(
                f"no decode worker is available (all are down or unreachable{why}); retry later",
                retry_after_s=NO_WORKER_RETRY_AFTER_S + held_s,
            )
        fitting = [w for w in workers if _fits(w, need)]
        if not fitting:
            return max(workers, key=lambda w: w.num_free_blocks)
        # Without a prefill pool the chosen worker also prefills: its prefill queue (a
        # long document in progress) decides the TTFT, so it weighs in.
        prefills_here = not any(w.available for w in self.prefill)

        def key(w: WorkerState) -> tuple[bool, float, float, int]:
            step = w.predicted_step_s(1, n)
            misses = slo.itl_s is not None and step > slo.itl_s
            wait = w.predicted_queue_s() if prefills_here else 0.0
            return (misses, wait, step, -w.num_free_blocks)

        return min(fitting, key=key)

    def _local_ttft(
        self, decode: WorkerState, uncached: int, slo: RequestSlo, *, forced: bool
    ) -> float:
        """Predicted TTFT of a local prefill on `decode`, or inf when it is not allowed."""
        cfg = self.config
        ttft = decode.predicted_queue_s() + decode.prefill_model.predict(uncached)
        if decode.num_running > 0:
            # Each prefill chunk shares its step with the running batch's decodes.
            num_chunks = -(-max(1, uncached) // max(1, cfg.local_prefill_chunk_tokens))
            ttft += num_chunks * decode.predicted_step_s()
        if forced:
            return ttft
        if uncached > cfg.max_local_prefill_tokens:
            return math.inf
        tightest = decode.min_itl_slo_s
        if tightest is not None and decode.num_running > 0:
            chunk = min(uncached, cfg.local_prefill_chunk_tokens)
            stall = decode.predicted_step_s() + decode.prefill_model.predict(chunk)
            if stall > tightest:
                return math.inf
        return ttft

    def _rescue_ttft(
        self, decode: WorkerState, uncached: int, slo: RequestSlo, remote_second_s: float
    ) -> float:
        """Local prefill in spite of the running requests' ITL guard, when disaggregating
        would miss this request's TTFT target (the prefill pool is busy, e.g. with a long
        document) and a local prefill answers sooner. The stall costs each running request
        one slow step — its mean ITL, which the SLO judges, barely moves — while waiting
        for the prefill pool would cost this request its whole SLO. As local prefills pile
        up the decode worker's predicted queue grows, until the pool is the sooner again.
        inf when not rescued."""
        target = slo.ttft_s
        if target is None or remote_second_s <= target:
            return math.inf
        if uncached > self.config.max_local_prefill_tokens:
            return math.inf
        ttft = self._local_ttft(decode, uncached, slo, forced=True)
        return ttft if ttft < remote_second_s else math.inf

    # ----- prefill side --------------------------------------------------------------

    def _pick_prefill(self, hashes: list[bytes], n: int) -> tuple[_PrefillOption | None, bool]:
        """Best prefill option and whether the load guard overrode pure affinity."""
        options = []
        for w in self.prefill:
            if not w.available:
                continue
            cached = w.prefix.match_blocks(hashes, n) * self.block_size
            wait = w.predicted_queue_s()
            options.append(
                _PrefillOption(w, wait, cached, wait + w.prefill_model.predict(n - cached))
            )
        if not options:
            return None, False
        cfg = self.config
        best_score = min(o.ttft_s for o in options)
        least_wait = min(o.wait_s for o in options)
        limit = cfg.affinity_max_wait_ratio * least_wait + cfg.affinity_min_wait_gap_s
        eligible = [o for o in options if o.wait_s <= limit]
        top = min(o.ttft_s for o in eligible)
        ties = [o for o in eligible if o.ttft_s <= top + cfg.score_tie_s]
        chosen = min(ties, key=lambda o: (len(o.worker.prefix), o.wait_s))
        return chosen, chosen.ttft_s > best_score + cfg.score_tie_s


def _fits(decode: WorkerState, need: int) -> bool:
    """Whether `decode` has the blocks a request needs free now. A forked request (n > 1,
    charged n outputs) may need more than the whole pool at its longest; its sequences
    then take turns by preemption, as they do under admission `none`: it fits once the
    pool is all free (uncapped, it never did)."""
    return decode.num_free_blocks >= min(need, decode.num_blocks)
