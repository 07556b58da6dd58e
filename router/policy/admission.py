"""SLO admission control (request-flow step 3, after pair selection).

`AdmissionController.evaluate` judges one placement against the request's SLO:

- policy `none`: always admit (the baseline: workers queue everything);
- the decode worker must have the request's KV blocks free;
- requests with a latency target are admitted when the predicted TTFT and ITL are
  within their targets; the predicted TTFT is first padded by a quantile of recent
  prediction errors (measured TTFT − predicted), so noise the models cannot see
  (a shared CPU, batching of concurrent prefills) does not turn into SLO misses;
- best-effort requests (no target, e.g. class `batch`) are admitted only into idle
  capacity: when the predicted queue wait is at most `best_effort_max_wait_s`, so the
  work they add to worker queues stays small for the interactive requests behind it;
- so is a request whose TTFT target its own prefill misses even with no queue (a
  prompt too long for it): no wait would let it meet the target, and a refusal with a
  short Retry-After was refused again on every retry;
- nobody is admitted ahead of a waiting request of higher or equal priority.

When a request cannot be admitted, policy `shed` rejects it at once with
`router.errors.Overloaded` (gRPC `RESOURCE_EXHAUSTED` / HTTP 429) and a Retry-After
estimate: how far the prediction misses the target, i.e. how long the excess queue
takes to drain. Policy `queue` parks it in `AdmissionQueue`: bounded, ordered by
priority then arrival, re-evaluated head-first whenever capacity frees (`notify`) and
every `recheck_interval_s`; it is shed after `queue_timeout_s`, or when the queue is
full (a full queue sheds its lowest-priority newest entry if the newcomer outranks
it, so `batch` never displaces `interactive`, only the reverse).
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tandem.router.errors import Overloaded
from tandem.router.policy.pair_selector import Placement
from tandem.router.policy.slo import RequestSlo

T = TypeVar("T")


class AdmissionPolicy(enum.StrEnum):
    SHED = "shed"  # 429 with Retry-After when no pair can meet the SLO
    QUEUE = "queue"  # park in a bounded priority queue, shed after queue_timeout_s
    NONE = "none"  # admit everything, route by prediction


# What a router does without being told (admit all, route by prediction).
DEFAULT_ADMISSION_POLICY = AdmissionPolicy.NONE


@dataclass(frozen=True)
class AdmissionConfig:
    policy: AdmissionPolicy = DEFAULT_ADMISSION_POLICY
    # Requests parked by policy `queue` (all priorities together).
    max_queue_len: int = 256
    # Longest a request waits in the router's queue before it is shed.
    queue_timeout_s: float = 5.0
    # Parked requests are re-evaluated at least this often (Stats polls move predictions).
    recheck_interval_s: float = 0.05
    # Best-effort requests enter only while the predicted queue wait is at most this.
    best_effort_max_wait_s: float = 0.1
    # Bounds of the Retry-After estimate.
    min_retry_after_s: float = 0.5
    max_retry_after_s: float = 30.0
    # Predicted TTFTs are padded by this quantile of recent (actual - predicted) errors,
    # so admission stays honest on noisy hardware; 0 turns the padding off.
    ttft_error_quantile: float = 0.9
    # Recent TTFT prediction errors kept for that quantile: at most this many, and
    # none older than the horizon (while everything is shed no new errors arrive, so
    # stale ones must age out or the padding would shed forever).
    ttft_error_window: int = 200
    ttft_error_horizon_s: float = 10.0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "policy", AdmissionPolicy(self.policy))
        except ValueError:
            known = ", ".join(p.value for p in AdmissionPolicy)
            raise ValueError(f"policy must be one of {known}, got {self.policy!r}") from None
        if self.max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {self.max_queue_len}")
        for name in ("queue_timeout_s", "recheck_interval_s", "min_retry_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.best_effort_max_wait_s < 0:
            raise ValueError(
                f"best_effort_max_wait_s must be >= 0, got {self.best_effort_max_wait_s}"
            )
        if not 0.0 <= self.ttft_error_quantile < 1.0:
            raise ValueError(
                f"ttft_error_quantile must be in [0, 1), got {self.ttft_error_quantile}"
            )
        if self.ttft_error_horizon_s <= 0:
            raise ValueError(f"ttft_error_horizon_s must be > 0, got {self.ttft_error_horizon_s}")
        if self.ttft_error_window < 1:
            raise ValueError(f"ttft_error_window must be >= 1, got {self.ttft_error_window}")
        if self.max_retry_after_s < self.min_retry_after_s:
            raise ValueError(
                f"max_retry_after_s must be >= min_retry_after_s, got {self.max_retry_after_s}"
            )


@dataclass(frozen=True)
class AdmissionDecision:
    admit: bool
    # Why not: "kv_blocks", "ttft", "ttft_out_of_reach", "itl", "idle_capacity",
    # "priority"; "" when admitted.
    reason: str = ""
    # When retrying is worth it (seconds), for a rejection.
    retry_after_s: float = 0.0


class AdmissionController:
    """Judges a placement against the request's SLO.

    Its only state is a window of recent TTFT prediction errors (actual − predicted),
    whose `ttft_error_quantile` pads every predicted TTFT before it is compared.
    """

    def __init__(
        self, config: AdmissionConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or AdmissionConfig()
        self.clock = clock
        # (observed at, actual - predicted TTFT), oldest first.
        self._ttft_errors: deque[tuple[float, float]] = deque(maxlen=self.config.ttft_error_window)

    def observe_ttft_error(self, error_s: float) -> None:
        """One admitted request's measured TTFT minus its predicted TTFT."""
        self._ttft_errors.append((self.clock(), error_s))

    @property
    def ttft_padding_s(self) -> float:
        """Seconds added to predicted TTFTs (never negative; 0 without recent errors)."""
        horizon = self.clock() - self.config.ttft_error_horizon_s
        while self._ttft_errors and self._ttft_errors[0][0] < horizon:
            self._ttft_errors.popleft()
        q = self.config.ttft_error_quantile
        if q == 0.0 or not self._ttft_errors:
            return 0.0
        errors = sorted(e for _, e in self._ttft_errors)
        return max(0.0, errors[min(len(errors) - 1, int(q * len(errors)))])

    def evaluate(
        self, placement: Placement, slo: RequestSlo, *, outranked: bool = False
    ) -> AdmissionDecision:
        """Admit now or not; `outranked`: a request of higher or equal priority is waiting."""
        cfg = self.config
        if cfg.policy is AdmissionPolicy.NONE:
            return AdmissionDecision(True)
        if outranked:
            return self._reject("priority", 0.0)
        if not placement.fits:
            return self._reject("kv_blocks", 0.0)
        if slo.is_best_effort:
            return self._into_idle_capacity(placement, "idle_capacity")
        predicted_ttft = placement.predicted_ttft_s + self.ttft_padding_s
        if slo.ttft_s is not None and predicted_ttft > slo.ttft_s:
            if predicted_ttft - placement.predicted_queue_s > slo.ttft_s:
                # Its own prefill misses the target with no queue at all: no wait makes
                # it meet it (a retry would be refused again, forever), so it is served
                # as best effort.
                return self._into_idle_capacity(placement, "ttft_out_of_reach")
            return self._reject("ttft", predicted_ttft - slo.ttft_s)
        if slo.itl_s is not None and placement.predicted_itl_s > slo.itl_s:
            return self._reject("itl", 0.0)
        return AdmissionDecision(True)

    def _into_idle_capacity(self, placement: Placement, reason: str) -> AdmissionDecision:
        """Admitted while the predicted queue wait is at most `best_effort_max_wait_s`."""
        excess = placement.predicted_queue_s - self.config.best_effort_max_wait_s
        return AdmissionDecision(True) if excess <= 0 else self._reject(reason, excess)

    def _reject(self, reason: str, excess_s: float) -> AdmissionDecision:
        cfg = self.config
        retry = min(cfg.max_retry_after_s, max(cfg.min_retry_after_s, excess_s))
        return AdmissionDecision(False, reason, retry)

    @staticmethod
    def overloaded(decision: AdmissionDecision) -> Overloaded:
        return Overloaded(
            f"no worker pair can meet the request's SLO now ({decision.reason})",
            retry_after_s=decision.retry_after_s,
        )


@dataclass(order=True)
class _Waiter:
    sort_key: tuple[int, int]
    req_id: str = field(compare=False)
    priority: int = field(compare=False)
    deadline_s: float = field(compare=False)
    # Commits and returns the placement when admissible now, else returns the decision.
    attempt: Callable[[], object] = field(compare=False)
    future: asyncio.Future = field(compare=False)
    last_retry_after_s: float = field(default=0.0, compare=False)


class AdmissionQueue(Generic[T]):
    """Requests waiting at the router for capacity (policy `queue`); see module docstring.

    `attempt()` must, atomically, select a pair, evaluate it and commit it: it returns
    the committed result, or an `AdmissionDecision` saying why not. Only the head is
    tried, so admission order is priority then arrival.
    """

    def __init__(self, config: AdmissionConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        self.num_timeouts = 0
        self.num_displaced = 0

    def __len__(self) -> int:
        return len(self._heap)

    def outranks(self, priority: int) -> bool:
        """Is a request of priority >= `priority` already waiting?"""
        return any(w.priority >= priority for w in self._heap)

    async def wait(
        self, req_id: str, priority: int, attempt: Callable[[], T | AdmissionDecision]
    ) -> T:
        """Park until `attempt` admits the request; raises `Overloaded` on timeout/full."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        waiter = _Waiter(
            (-priority, next(self._seq)),
            req_id,
            priority,
            self.clock() + cfg.queue_timeout_s,
            attempt,
            loop.create_future(),
        )
        self._make_room(waiter)
        heapq.heappush(self._heap, waiter)
        try:
            self.notify()
            while not waiter.future.done():
                remaining = waiter.deadline_s - self.clock()
                if remaining <= 0:
                    self.num_timeouts += 1
                    retry = max(cfg.min_retry_after_s, waiter.last_retry_after_s)
                    raise Overloaded(
                        f"request waited {cfg.queue_timeout_s:g}s for capacity",
                        retry_after_s=min(cfg.max_retry_after_s, retry),
                    )
                await asyncio.wait({waiter.future}, timeout=min(remaining, cfg.recheck_interval_s))
                if not waiter.future.done():
                    self.notify()
            return waiter.future.result()
        finally:
            if waiter in self._heap:
                self._heap.remove(waiter)
                heapq.heapify(self._heap)

    def _make_room(self, waiter: _Waiter) -> None:
        if len(self._heap) < self.config.max_queue_len:
            return
        victim = max(self._heap, default=None)  # lowest priority, newest
        if victim is None or victim.priority >= waiter.priority:
            raise Overloaded("admission queue is full", retry_after_s=self.config.min_retry_after_s)
        self._heap.remove(victim)
        heapq.heapify(self._heap)
        self.num_displaced += 1
        victim.future.set_exception(
            Overloaded(
                "displaced from the admission queue by a higher-priority request",
                retry_after_s=self.config.min_retry_after_s,
            )
        )

    def notify(self) -> int:
        """Capacity may have freed: admit waiters head-first while they fit; how many."""
        admitted = 0
        while self._heap:
            head = self._heap[0]
            if head.future.done():  # cancelled by its caller
                heapq.heappop(self._heap)
                continue
            try:
                result = head.attempt()
            except Exception as exc:  # belongs to that request, not to whoever notified
                heapq.heappop(self._heap)
                head.future.set_exception(exc)
                continue
            if isinstance(result, AdmissionDecision):
                head.last_retry_after_s = result.retry_after_s
                break
            heapq.heappop(self._heap)
            head.future.set_result(result)
            admitted += 1
        return admitted
