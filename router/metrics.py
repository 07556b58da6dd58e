"""Router metrics in Prometheus exposition, with vLLM's names under `tandem:`.

One `RouterMetrics` per router (its own registry, no module globals). Every API goes
through `RequestFlow`, which reports each request's lifecycle to a `RequestRecord`,
so counts and histograms are the same whichever API a request came in on.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tandem.router.pool_gauges import PlannerGauges, PoolGauges

# Bucket bounds follow vLLM's, so dashboards and alerts port unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0)  # fmt: skip
# Generated tokens of one finished request (vLLM's request_generation_tokens buckets,
# 1-2-5 steps).
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                  100000)  # fmt: skip
# Queue and prefill time of a request (vLLM's request_queue/prefill_time buckets).
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
# Finished requests the SLO-attainment gauge averages over.
SLO_WINDOW = 1000
# Label values exported at 0 from the start, so dashboards and alerts see a series
# before the first event (a counter that does not exist yet reads as "No data").
DISAGG_DECISIONS = ("disaggregated", "local_prefill")
MIGRATION_REASONS = ("prefill_failed", "decode_failed", "worker_lost")


class RouterMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.request_success = Counter(
            "tandem:request_success", "Finished requests.", [*labels, "finished_reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "tandem:prompt_tokens", "Prompt tokens of admitted requests.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "tandem:generation_tokens", "Generated tokens.", labels, registry=r
        )
        # Counted when a request ends, so its mean over finished requests is the mean
        # output length (generation_tokens over request_success counts the tokens of
        # requests still running too: 1.6x too long in a window of long streams).
        self.request_generation_tokens = Histogram(
            "tandem:request_generation_tokens",
            "Generated tokens of each finished request.",
            labels,
            buckets=LENGTH_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "tandem:time_to_first_token_seconds",
            "Time to first token, from arrival at the router.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tandem:inter_token_latency_seconds",
            "Gap between consecutive streamed tokens.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tandem:e2e_request_latency_seconds",
            "Arrival to last token.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.kv_transfer = Histogram(
            "tandem:kv_transfer_seconds",
            "KV pull time on the decode worker.",
            labels,
            buckets=TRANSFER_BUCKETS,
            registry=r,
        )
        self.running = Gauge(
            "tandem:num_requests_running", "Requests streaming.", labels, registry=r
        )
        self.waiting = Gauge(
            "tandem:num_requests_waiting",
            "Requests waiting at the router for a worker pair (the admission queue).",
            labels,
            registry=r,
        )
        self.disagg_decisions = Counter(
            "tandem:disagg_decisions",
            "Where prefill ran: on a prefill worker or locally on the decode worker.",
            [*labels, "decision"],
            registry=r,
        )
        self.goodput = Counter(
            "tandem:goodput_requests", "Finished requests that met their SLO.", labels, registry=r
        )
        self.rejected = Counter(
            "tandem:requests_rejected",
            "Requests refused before placement: shed by admission (overloaded), or no worker "
            "to place them on (unavailable).",
            [*labels, "reason"],
            registry=r,
        )
        self.migrations = Counter(
            "tandem:request_migrations",
            "Requests moved to another worker after theirs failed, by reason "
            "(prefill_failed, decode_failed, worker_lost).",
            [*labels, "reason"],
            registry=r,
        )
        self.slo_attainment = Gauge(
            "tandem:slo_attainment",
            f"Fraction of the last {SLO_WINDOW} finished requests that met their SLO.",
            labels,
            registry=r,
        )
        # TTFT's parts: waiting (router admission + the prefilling engine's queue), then
        # prefill compute; the KV transfer that follows is `kv_transfer_seconds`.
        self.queue_time = Histogram(
            "tandem:request_queue_time_seconds",
            "Admission wait at the router plus queue time in the prefilling engine.",
            labels,
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            "tandem:request_prefill_time_seconds",
            "Prefill compute: first chunk scheduled to first token.",
            labels,
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "tandem:time_per_output_token_seconds",
            "Mean gap between output tokens of a finished request (TPOT).",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        # Per worker, as this router placed work on it (sum over routers for the total).
        self.worker_prompt_tokens = Counter(
            "tandem:worker_prompt_tokens",
            "Prompt tokens a worker computed (cached ones excluded) for this router.",
            [*labels, "worker_id", "role"],
            registry=r,
        )
        self.worker_generation_tokens = Counter(
            "tandem:worker_generation_tokens",
            "Tokens a decode worker streamed for this router.",
            [*labels, "worker_id"],
            registry=r,
        )
        for series in (self.running, self.waiting, self.goodput):
            series.labels(model_name)
        for reason in ("overloaded", "unavailable"):
            self.rejected.labels(model_name, reason)
        for decision in DISAGG_DECISIONS:
            self.disagg_decisions.labels(model_name, decision)
        for reason in MIGRATION_REASONS:
            self.migrations.labels(model_name, reason)
        self._slo_window: deque[bool] = deque(maxlen=SLO_WINDOW)
        # The live P:D planner's view (`tandem.planner.live` sets it when one runs).
        self.planner = PlannerGauges(r)
        # tandem:pool_workers / pool_target_workers / worker_restarts_total, re-exported
        # from the membership the router follows (fed by `Router.update_membership`).
        self.pools = PoolGauges(r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def record(self, num_prompt_tokens: int, ttft_target_s: float | None = None,
               itl_target_s: float | None = None,
               arrived_at: float | None = None) -> RequestRecord:  # fmt: skip
        """Start tracking one admitted request; `arrived_at`: when it reached the router
        (monotonic; now by default), so that its TTFT, latency and SLO include the time it
        waited for admission."""
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)
        self.running.labels(self.model_name).inc()
        now = time.monotonic()
        arrival = now if arrived_at is None else arrived_at
        return RequestRecord(self, ttft_target_s, itl_target_s, now - arrival, arrival)

    def _finish(self, record: RequestRecord, reason: str) -> None:
        name = self.model_name
        self.running.labels(name).dec()
        self.request_success.labels(name, reason).inc()
        self.request_generation_tokens.labels(name).observe(record.num_tokens)
        if record.first_token_at is not None:
            self.e2e.labels(name).observe(record.last_token_at - record.arrival)
        if record.num_tokens > 1 and record.first_token_at is not None:
            gaps_s = record.last_token_at - record.first_token_at
            self.tpot.labels(name).observe(gaps_s / (record.num_tokens - 1))
        # A request that failed or was aborted is no goodput, however fast its tokens came.
        met = reason in ("stop", "length") and record.met_slo()
        self._slo_window.append(met)
        if met:
            self.goodput.labels(name).inc()
        self.slo_attainment.labels(name).set(sum(self._slo_window) / len(self._slo_window))


@dataclass
class RequestRecord:
    """Timestamps of one request, fed by the request flow as chunks stream."""

    metrics: RouterMetrics
    ttft_target_s: float | None
    itl_target_s: float | None
    admission_wait_s: float = 0.0
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float = 0.0
    num_tokens: int = 0
    finished: bool = False
    # Whether the request's first prefill was counted in the TTFT split.
    _prefilled: bool = False

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        name = self.metrics.model_name
        self.metrics.generation_tokens.labels(name).inc(num_tokens)
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.ttft.labels(name).observe(now - self.arrival)
            num_gaps = num_tokens - 1
            gap = 0.0
        else:
            num_gaps = num_tokens
            gap = (now - self.last_token_at) / num_tokens
        for _ in range(num_gaps):
            self.metrics.itl.labels(name).observe(gap)
        self.last_token_at = now
        self.num_tokens += num_tokens

    def on_kv_transfer(self, seconds: float) -> None:
        self.metrics.kv_transfer.labels(self.metrics.model_name).observe(seconds)

    def on_prefill(self, worker_id: str, role: str, num_computed_tokens: int,
                   queue_s: float, compute_s: float) -> None:  # fmt: skip
        """A prefill finished on `worker_id` (a prefill worker, or a decode worker
        prefilling locally); the first one of a request also feeds the TTFT split."""
        m, name = self.metrics, self.metrics.model_name
        m.worker_prompt_tokens.labels(name, worker_id, role).inc(max(0, num_computed_tokens))
        if not self._prefilled:
            self._prefilled = True
            m.queue_time.labels(name).observe(self.admission_wait_s + queue_s)
            m.prefill_time.labels(name).observe(compute_s)

    def on_decoded(self, worker_id: str, num_tokens: int) -> None:
        """`num_tokens` streamed from decode worker `worker_id`."""
        if num_tokens > 0:
            name = self.metrics.model_name
            self.metrics.worker_generation_tokens.labels(name, worker_id).inc(num_tokens)

    def met_slo(self) -> bool:
        """TTFT within target, and mean inter-token time (TPOT, as DistServe) within
        the ITL target."""
        if self.first_token_at is None:
            return False
        ttft = self.first_token_at - self.arrival
        ttft_ok = self.ttft_target_s is None or ttft <= self.ttft_target_s
        tpot = 0.0
        if self.num_tokens > 1:
            tpot = (self.last_token_at - self.first_token_at) / (self.num_tokens - 1)
        itl_ok = self.itl_target_s is None or tpot <= self.itl_target_s
        return ttft_ok and itl_ok

    def finish(self, reason: str) -> None:
        """Count the request once, whatever ended it ("stop", "length", "abort", "error")."""
        if not self.finished:
            self.finished = True
            self.metrics._finish(self, reason)
