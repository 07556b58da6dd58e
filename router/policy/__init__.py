"""Goodput-aware scheduling policy of the router (request-flow steps 2–3).

Small pure objects, no I/O, unit-testable on CPU:

- `slo`: `Slo` targets, `SloClass` presets (`interactive`, `batch`), `SloConfig.resolve`
  → `RequestSlo` (targets + priority) for each request.
- `latency_model`: per-worker `PrefillLatencyModel` (`a + b·n + c·n²`) and
  `DecodeLatencyModel` (`a + b·batch + c·context`), seeded from a profile, refitted
  online over a bounded, exponentially weighted window.
- `prefix_tree`: `PrefixIndex`, the router's approximate, LRU-bounded, lockable copy
  of one worker's prefix cache, keyed by the engine's own chained block hashes.
- `worker_state`: `WorkerState`, the live view of one worker: last `Stats` snapshot +
  the router's in-flight deltas + its latency models + its prefix index.
- `pair_selector`: `PairSelector.select` → `Placement` (prefill worker or local
  prefill, decode worker, predicted TTFT/ITL, decision label).
- `admission`: `AdmissionController` (admit / shed with Retry-After) and
  `AdmissionQueue` (bounded priority queue for policy `queue`).
- `goodput_policy`: `GoodputPolicy`, the one object `RequestFlow` drives:
  `place(PlacementRequest)` on arrival, then `on_prefill_done` / `on_kv_pulled` /
  `observe_itl` / `on_finish` as the request progresses.
"""

from tandem.router.policy.admission import (
    DEFAULT_ADMISSION_POLICY,
    AdmissionConfig,
    AdmissionController,
    AdmissionDecision,
    AdmissionPolicy,
    AdmissionQueue,
)
from tandem.router.policy.goodput_policy import GoodputPolicy, PlacementRequest
from tandem.router.policy.latency_model import (
    DecodeLatencyModel,
    DecodeObservation,
    PrefillLatencyModel,
    PrefillObservation,
)
from tandem.router.policy.pair_selector import (
    DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
    DISAGGREGATED,
    LOCAL_PREFILL,
    PairSelector,
    Placement,
    SelectorConfig,
)
from tandem.router.policy.prefix_tree import PrefixIndex, block_hashes
from tandem.router.policy.slo import BATCH, INTERACTIVE, RequestSlo, Slo, SloClass, SloConfig
from tandem.router.policy.worker_state import WorkerState, WorkerStats

__all__ = [
    "BATCH",
    "DEFAULT_ADMISSION_POLICY",
    "DEFAULT_MAX_LOCAL_PREFILL_TOKENS",
    "DISAGGREGATED",
    "INTERACTIVE",
    "LOCAL_PREFILL",
    "AdmissionConfig",
    "AdmissionController",
    "AdmissionDecision",
    "AdmissionPolicy",
    "AdmissionQueue",
    "DecodeLatencyModel",
    "DecodeObservation",
    "GoodputPolicy",
    "PairSelector",
    "Placement",
    "PlacementRequest",
    "PrefillLatencyModel",
    "PrefillObservation",
    "PrefixIndex",
    "RequestSlo",
    "SelectorConfig",
    "Slo",
    "SloClass",
    "SloConfig",
    "WorkerState",
    "WorkerStats",
    "block_hashes",
]
