"""The router's live view of one worker: last `Stats` snapshot plus what changed since.

Stats polls are periodic, but routing decisions happen per request, so every
estimate is `snapshot + changes the router caused after the snapshot was taken`.
The router records each change it causes (a request sent, prefilled, completed) as a
timestamped delta; a new snapshot taken at `t` absorbs the deltas up to `t` and the
rest are replayed on top of it. A change is counted once, however sends, completions
and polls interleave; skew between the router's and the worker's clocks shows up as
transient error that the next poll corrects.

Accounted per worker:
- prefill queue: requests and uncached prompt tokens sent and not yet prefilled;
- decode batch: requests sent to a decode worker and not yet finished;
- KV blocks: a prefill worker holds a prompt's blocks until the KV is pulled; a decode
  worker is charged `prompt + max_tokens` blocks (worst case) until the request ends;
- SLOs of the requests decoding here, so local prefill can respect their ITL.

The worker's latency models and approximate prefix index live here too: they are the
other half of "what will happen if I send this request there".
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from tandem.engine.config import parse_enum
from tandem.router.policy.latency_model import DecodeLatencyModel, PrefillLatencyModel
from tandem.router.policy.prefix_tree import PrefixIndex
from tandem.worker.config import WorkerRole

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerStats:
    """The fields of `tandem.worker.v1.StatsResponse` the policy reads."""

    num_waiting: int = 0
    num_running: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    # Uncomputed prompt tokens in the engine's queue (waiting and partially prefilled).
    num_queued_prefill_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @classmethod
    def from_proto(cls, msg: Any) -> WorkerStats:
        """From a `StatsResponse` (read by field name, so this module needs no stubs)."""
        return cls(**{name: int(getattr(msg, name)) for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class _Delta:
    """A change to the worker's load caused by the router."""

    num_prefill_requests: int = 0
    num_prefill_tokens: int = 0
    num_running: int = 0
    num_used_blocks: int = 0

    def __add__(self, other: _Delta) -> _Delta:
        return _Delta(
            self.num_prefill_requests + other.num_prefill_requests,
            self.num_prefill_tokens + other.num_prefill_tokens,
            self.num_running + other.num_running,
            self.num_used_blocks + other.num_used_blocks,
        )

    def __neg__(self) -> _Delta:
        return _Delta(
            -self.num_prefill_requests,
            -self.num_prefill_tokens,
            -self.num_running,
            -self.num_used_blocks,
        )


_ZERO = _Delta()


@dataclass
class InFlight:
    """One request the router sent to this worker and has not seen finish."""

    req_id: str
    # Prompt tokens this worker computes (prompt minus predicted prefix hit); 0 when
    # a decode worker receives remote-prefilled KV.
    num_prefill_tokens: int
    # KV blocks charged to the request on this worker.
    num_blocks: int
    # Whether it joins this worker's decode batch.
    decoding: bool
    # Its ITL target, if any (a local prefill here must not break it).
    itl_slo_s: float | None
    sent_at_s: float
    prefilled: bool = False


class WorkerState:
    """Snapshot + router-side accounting + latency models + prefix index of one worker."""

    def __init__(
        self,
        worker_id: str,
        role: WorkerRole,
        *,
        block_size: int,
        num_blocks: int,
        prefill_model: PrefillLatencyModel | None = None,
        decode_model: DecodeLatencyModel | None = None,
        max_events: int = 4096,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.worker_id = worker_id
        self.role = parse_enum(WorkerRole, role, "role")
        self.block_size = block_size
        self.prefill_model = prefill_model or PrefillLatencyModel()
        self.decode_model = decode_model or DecodeLatencyModel()
        self.prefix = PrefixIndex(block_size, num_blocks)
        # False while the worker is draining, unhealthy or gone: never selected.
        self.available = True
        self.stats = WorkerStats(num_blocks=num_blocks, num_free_blocks=num_blocks)
        self.stats_taken_at_s: float | None = None
        self.in_flight: dict[str, InFlight] = {}
        # Deltas after the snapshot, oldest first; overflow folds into `_folded`.
        self._events: deque[tuple[float, _Delta]] = deque()
        self._max_events = max_events
        self._folded = _ZERO
        self._folded_until_s = float("-inf")
        self._delta = _ZERO

    # ----- inputs ------------------------------------------------------------------

    def update_stats(self, stats: WorkerStats, taken_at_s: float) -> None:
        """A new snapshot, taken (by the router's clock) at `taken_at_s`."""
        if self.stats_taken_at_s is not None and taken_at_s < self.stats_taken_at_s:
            return  # an older poll answered late
        self.stats = stats
        self.stats_taken_at_s = taken_at_s
        if stats.num_blocks > 0:
            self.prefix.set_capacity(stats.num_blocks)
        while self._events and self._events[0][0] <= taken_at_s:
            self._events.popleft()
        if taken_at_s >= self._folded_until_s:
            self._folded = _ZERO
        self._delta = self._folded
        for _, delta in self._events:
            self._delta = self._delta + delta

    def on_send(
        self,
        req_id: str,
        *,
        num_prefill_tokens: int,
        num_blocks: int,
        decoding: bool,
        now_s: float,
        itl_slo_s: float | None = None,
    ) -> None:
        """The router sent `req_id` here (prefill, or decode with or without local prefill)."""
        if req_id in self.in_flight:
            raise ValueError(f"request {req_id!r} is already in flight on {self.worker_id}")
        flight = InFlight(req_id, num_prefill_tokens, num_blocks, decoding, itl_slo_s, now_s)
        self.in_flight[req_id] = flight
        self._record(now_s, self._load(flight, prefill=True, held=True))

    def on_prefill_done(self, req_id: str, now_s: float) -> bool:
        """The worker finished `req_id`'s prompt (first token out); blocks stay held."""
        flight = self.in_flight.get(req_id)
        if flight is None or flight.prefilled:
            return False
        flight.prefilled = True
        self._record(now_s, -self._load(flight, prefill=True, held=False))
        return True

    def on_complete(self, req_id: str, now_s: float) -> bool:
        """`req_id` holds nothing here any more (finished, pulled, aborted or failed)."""
        flight = self.in_flight.pop(req_id, None)
        if flight is None:
            return False
        self._record(now_s, -self._load(flight, prefill=not flight.prefilled, held=True))
        return True

    @staticmethod
    def _load(flight: InFlight, *, prefill: bool, held: bool) -> _Delta:
        queued = prefill and flight.num_prefill_tokens > 0
        return _Delta(
            num_prefill_requests=int(queued),
            num_prefill_tokens=flight.num_prefill_tokens if queued else 0,
            num_running=int(held and flight.decoding),
            num_used_blocks=flight.num_blocks if held else 0,
        )

    def _record(self, now_s: float, delta: _Delta) -> None:
        if len(self._events) >= self._max_events:
            t, old = self._events.popleft()
            self._folded = self._folded + old
            self._folded_until_s = t
        self._events.append((now_s, delta))
        self._delta = self._delta + delta

    # ----- estimates -----------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return max(1, self.stats.num_blocks)

    @property
    def num_queued_prefill_tokens(self) -> int:
        return max(0, self.stats.num_queued_prefill_tokens + self._delta.num_prefill_tokens)

    @property
    def num_queued_prefills(self) -> int:
        """Requests with prompt tokens still to compute here."""
        snap = self.stats.num_waiting
        if self.role is WorkerRole.PREFILL:
            snap += self.stats.num_running  # all of them are prefilling
        return max(0, snap + self._delta.num_prefill_requests)

    @property
    def num_running(self) -> int:
        """Decode batch size (0 on a prefill worker)."""
        if self.role is WorkerRole.PREFILL:
            return 0
        return max(0, self.stats.num_running + self._delta.num_running)

    @property
    def num_used_blocks(self) -> int:
        used = self.stats.num_blocks - self.stats.num_free_blocks + self._delta.num_used_blocks
        return min(self.num_blocks, max(0, used))

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.num_used_blocks

    @property
    def num_context_tokens(self) -> int:
        """KV tokens held by running requests (used blocks × block size)."""
        return self.num_used_blocks * self.block_size

    @property
    def min_itl_slo_s(self) -> float | None:
        """Tightest ITL target among requests decoding here (router-side knowledge)."""
        targets = [f.itl_slo_s for f in self.in_flight.values() if f.decoding and f.itl_slo_s]
        return min(targets) if targets else None

    def predicted_queue_s(self) -> float:
        """Seconds until a prompt sent now would start prefilling here."""
        return self.prefill_model.predict_queue(
            self.num_queued_prefill_tokens, max(1, self.num_queued_prefills)
        )

    def predicted_step_s(self, extra_requests: int = 0, extra_context_tokens: int = 0) -> float:
        """Decode step time if the batch grew by the given requests and tokens."""
        return self.decode_model.predict(
            self.num_running + extra_requests, self.num_context_tokens + extra_context_tokens
        )

    def is_idle(self) -> bool:
        """Nothing in flight from the router's side (what leak checks assert)."""
        return not self.in_flight and self.prefix.num_locked_requests == 0
