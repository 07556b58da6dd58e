"""The goodput-aware routing policy as one object `RequestFlow` drives.

`place()` = select a pair → admit / queue / shed → commit (account the request on
both workers and in their prefix indexes). The request flow then reports the
request's progress so the live view stays right and the latency models learn:

    request = PlacementRequest(req_id, prompt_ids, max_tokens, slo)
    placement = await policy.place(request)  # may raise Overloaded
    try:
        # disaggregated: PrefillResponse arrived (token 1 streamed to the client)
        policy.on_prefill_done(req_id, num_cached_tokens=r.num_cached_tokens,
                               compute_s=r.timings.compute_s)
        # first Decode message: KV pulled, the prefill worker let its blocks go
        # (local prefill: this is also when the prompt is done -> on_prefill_done)
        policy.on_kv_pulled(req_id)
        policy.observe_itl(req_id, gap_s)            # per later Decode message, optional
    finally:
        policy.on_finish(req_id, output_ids)          # success, error or cancel: always

Every hook is idempotent and `on_finish` releases whatever is still held, so a
request that fails anywhere leaves no accounting behind (`is_idle()` checks it).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.router.errors import Overloaded
from tandem.router.policy.admission import (
    AdmissionConfig,
    AdmissionController,
    AdmissionDecision,
    AdmissionPolicy,
    AdmissionQueue,
)
from tandem.router.policy.pair_selector import PairSelector, Placement, SelectorConfig
from tandem.router.policy.slo import RequestSlo
from tandem.router.policy.worker_state import WorkerState, WorkerStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlacementRequest:
    """What the policy needs to know about one request to place it."""

    req_id: str
    prompt_ids: Sequence[int]
    max_tokens: int
    slo: RequestSlo
    # The request's cache salt: its prompt's blocks hash with it, as on the workers.
    cache_salt: str | None = None


@dataclass
class _Record:
    """What the policy remembers about an admitted request until it finishes."""

    placement: Placement
    slo: RequestSlo
    prompt_ids: Sequence[int]
    prefill_done: bool = False
    kv_pulled: bool = False


class GoodputPolicy:
    """Selector + admission + live worker view; one per router, used from its event loop."""

    def __init__(
        self,
        prefill: Sequence[WorkerState],
        decode: Sequence[WorkerState],
        *,
        selector_config: SelectorConfig | None = None,
        admission_config: AdmissionConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.selector = PairSelector(prefill, decode, selector_config)
        self.admission = AdmissionController(admission_config, clock)
        self.queue: AdmissionQueue[Placement] = AdmissionQueue(self.admission.config, clock)
        self.clock = clock
        self.workers = {w.worker_id: w for w in (*prefill, *decode)}
        if len(self.workers) != len(prefill) + len(decode):
            raise ValueError("worker ids must be unique")
        self._requests: dict[str, _Record] = {}
        # Workers removed from the pools while requests were still charged to them: kept
        # in `workers` until those requests end, so their accounting unwinds.
        self._retiring: set[str] = set()
        # Placements per decision label (`tandem:disagg_decisions_total{decision}`).
        self.decisions: Counter[str] = Counter()
        # Requests not admitted at once, per reason ("ttft", "kv_blocks", ...); "queue":
        # shed after waiting (timeout, full queue, displaced).
        self.rejections: Counter[str] = Counter()
        # Predicted vs reported prefix hits, to watch the approximate index's accuracy.
        self.num_predicted_cached_tokens = 0
        self.num_reported_cached_tokens = 0

    # ----- admission ---------------------------------------------------------------

    def place_now(self, request: PlacementRequest) -> Placement:
        """Place and commit the request now, or raise `Overloaded` (any policy but `none`)."""
        result = self._attempt(request, self.queue.outranks)
        if isinstance(result, AdmissionDecision):
            self.rejections[result.reason] += 1
            raise self.admission.overloaded(result)
        return result

    async def place(self, request: PlacementRequest) -> Placement:
        """Place and commit the request; under policy `queue` wait for capacity first."""
        if self.admission.config.policy is not AdmissionPolicy.QUEUE:
            return self.place_now(request)
        result = self._attempt(request, self.queue.outranks)
        if not isinstance(result, AdmissionDecision):
            return result
        self.rejections[result.reason] += 1
        try:
            return await self.queue.wait(
                request.req_id, request.slo.priority, lambda: self._attempt(request, None)
            )
        except Overloaded:
            self.rejections["queue"] += 1
            raise
        except BaseException:
            # Admitted by a `notify` but cancelled before we resumed: undo the commit.
            self.on_finish(request.req_id)
            raise

    def place_migrated(self, request: PlacementRequest) -> Placement:
        """Place a request again after its worker failed (`prompt_ids`: prompt plus the
        tokens already streamed). It was admitted once, so admission does not shed it;
        `WorkerUnavailable` when no decode worker is available."""
        if request.req_id in self._requests:
            raise ValueError(f"request {request.req_id!r} is still placed; finish it first")
        placement = self._select(request)
        self._commit(request, placement)
        return placement

    def _attempt(
        self, request: PlacementRequest, outranks: Callable[[int], bool] | None
    ) -> Placement | AdmissionDecision:
        if request.req_id in self._requests:
            raise ValueError(f"request {request.req_id!r} is already placed")
        placement = self._select(request)
        slo = request.slo
        outranked = outranks(slo.priority) if outranks is not None else False
        decision = self.admission.evaluate(placement, slo, outranked=outranked)
        if not decision.admit:
            return decision
        self._commit(request, placement)
        return placement

    def _select(self, request: PlacementRequest) -> Placement:
        return self.selector.select(
            request.prompt_ids, request.max_tokens, request.slo, request.cache_salt
        )

    def _commit(self, request: PlacementRequest, placement: Placement) -> None:
        req_id, prompt_ids, slo = request.req_id, request.prompt_ids, request.slo
        now = self.clock()
        hashes = placement.prompt_hashes
        decode = self.workers[placement.decode_worker_id]
        local = placement.prefill_worker_id is None
        if placement.prefill_worker_id is not None:
            prefill = self.workers[placement.prefill_worker_id]
            prefill.on_send(
                req_id,
                num_prefill_tokens=placement.num_prefill_tokens,
                num_blocks=-(-placement.num_prompt_tokens // prefill.block_size),
                decoding=False,
                now_s=now,
            )
            prefill.prefix.insert(prompt_ids, req_id, hashes)
        decode.on_send(
            req_id,
            num_prefill_tokens=placement.num_prefill_tokens if local else 0,
            num_blocks=placement.num_decode_blocks,
            decoding=True,
            now_s=now,
            itl_slo_s=slo.itl_s,
        )
        # Imported KV lands in the decode worker's prefix cache too.
        decode.prefix.insert(prompt_ids, req_id, hashes)
        self._requests[req_id] = _Record(placement, slo, prompt_ids)
        self.decisions[placement.decision] += 1
        self.num_predicted_cached_tokens += placement.num_cached_tokens

    # ----- progress hooks ------------------------------------------------------------

    def on_prefill_done(
        self,
        req_id: str,
        *,
        num_cached_tokens: int | None = None,
        compute_s: float | None = None,
    ) -> None:
        """Token 1 is out: the prompt left the prefill queue (and teaches the model)."""
        record = self._requests.get(req_id)
        if record is None or record.prefill_done:
            return
        record.prefill_done = True
        p = record.placement
        worker = self.workers.get(p.prefill_worker_id or p.decode_worker_id)
        if worker is not None:
            worker.on_prefill_done(req_id, self.clock())
        if num_cached_tokens is not None:
            self.num_reported_cached_tokens += num_cached_tokens
            if compute_s is not None and worker is not None:
                worker.prefill_model.observe(p.num_prompt_tokens - num_cached_tokens, compute_s)
        self.queue.notify()

    def on_kv_pulled(self, req_id: str) -> None:
        """The decode side has the KV: the prefill worker's blocks are no longer pinned."""
        record = self._requests.get(req_id)
        if record is None or record.kv_pulled:
            return
        record.kv_pulled = True
        self.on_prefill_done(req_id)  # no-op if already reported
        p = record.placement
        prefill = self.workers.get(p.prefill_worker_id) if p.prefill_worker_id else None
        if prefill is None:
            return
        prefill.on_complete(req_id, self.clock())
        prefill.prefix.unlock(req_id)
        self._drop_retired(prefill.worker_id)
        self.queue.notify()

    def observe_ttft(self, req_id: str, ttft_s: float) -> None:
        """The admitted request's first token came `ttft_s` after placement (feeds the
        admission padding with the prediction's error)."""
        record = self._requests.get(req_id)
        if record is not None:
            self.admission.observe_ttft_error(ttft_s - record.placement.predicted_ttft_s)

    def observe_itl(self, req_id: str, itl_s: float) -> None:
        """One observed inter-token gap of a decoding request (teaches the decode model)."""
        record = self._requests.get(req_id)
        if record is None:
            return
        decode = self.workers.get(record.placement.decode_worker_id)
        if decode is None:
            return
        decode.decode_model.observe(decode.num_running, decode.num_context_tokens, itl_s)

    def on_finish(self, req_id: str, output_ids: Sequence[int] = ()) -> None:
        """The request ended (any way): release everything the policy still charges it."""
        record = self._requests.pop(req_id, None)
        if record is None:
            return
        now = self.clock()
        p = record.placement
        # A worker that left the pools is forgotten once it holds nothing for us: a
        # prefill worker as soon as the KV was pulled (`on_kv_pulled`).
        prefill = self.workers.get(p.prefill_worker_id) if p.prefill_worker_id else None
        if prefill is not None:
            prefill.on_complete(req_id, now)
            prefill.prefix.unlock(req_id)
            self._drop_retired(prefill.worker_id)
        decode = self.workers.get(p.decode_worker_id)
        if decode is not None:
            decode.on_complete(req_id, now)
            decode.prefix.unlock(req_id)
            if output_ids and p.decode_worker_id not in self._retiring:
                # Generated tokens' blocks are cached too: a follow-up turn can hit them.
                decode.prefix.insert([*record.prompt_ids, *output_ids])
            self._drop_retired(p.decode_worker_id)
        self.queue.notify()

    def update_stats(self, worker_id: str, stats: WorkerStats, taken_at_s: float) -> None:
        worker = self.workers.get(worker_id)
        if worker is None:
            return  # left the pools while its poll was in flight
        worker.update_stats(stats, taken_at_s)
        self.queue.notify()

    def add_worker(self, worker: WorkerState) -> None:
        """A new worker joins the pools (placement starts at once if it is available)."""
        if worker.worker_id in self._retiring:
            # Back before its old requests ended: keep their accounting, place again.
            worker = self.workers[worker.worker_id]
            self._retiring.discard(worker.worker_id)
        elif worker.worker_id in self.workers:
            raise ValueError(f"worker {worker.worker_id} is already in the pools")
        self.selector.add_worker(worker)
        self.workers[worker.worker_id] = worker
        self.queue.notify()

    def remove_worker(self, worker_id: str) -> None:
        """A worker leaves the pools: no new placements; the requests still charged to it
        keep their accounting until `on_finish` (migration ends them there first)."""
        worker = self.workers.get(worker_id)
        if worker is None:
            return
        worker.available = False
        self.selector.remove_worker(worker_id)
        self._retiring.add(worker_id)
        self._drop_retired(worker_id)

    def _drop_retired(self, worker_id: str) -> None:
        worker = self.workers.get(worker_id)
        if worker_id in self._retiring and worker is not None and not worker.in_flight:
            del self.workers[worker_id]
            self._retiring.discard(worker_id)

    def set_available(self, worker_id: str, available: bool) -> None:
        """Mark a worker (un)usable: draining, failed health checks, back again."""
        worker = self.workers.get(worker_id)
        if worker is None or worker_id in self._retiring:
            return
        worker.available = available
        if available:
            self.queue.notify()

    # ----- introspection -------------------------------------------------------------

    def placement_of(self, req_id: str) -> Placement | None:
        record = self._requests.get(req_id)
        return record.placement if record else None

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def is_idle(self) -> bool:
        """No request charged anywhere and nobody queued (leak checks assert it)."""
        return (
            not self._requests
            and not len(self.queue)
            and all(w.is_idle() for w in self.workers.values())
        )
