"""Discrete-event simulation of a Tandem cluster serving a workload at one arrival rate.

The cluster as built: the router's own `GoodputPolicy` (`tandem.router.policy`), fed
the profile's latency laws as its models, places every request (prefill worker or
local prefill on the decode worker: conditional disaggregation; colocated workers
when there is no prefill pool). Each worker is a `SimWorker` (continuous batching
under the engine's token budget, chunked prefill). A prefilled request's KV is pulled
by its decode worker when that worker has blocks for it (pull-based admission); the
pull takes the profile's transfer time, and the prefill worker holds the blocks
until then, or until the lease expires, after which the decode worker prefills the
prompt itself (as the real one does after a failed pull).

Events: arrivals, step ends, pull ends. Time is the simulation's own clock; the
policy reads it through its injected clock. A run may stop early once too many
requests have missed their SLO for the run to reach `stop_below` attainment; with
`until_s` it stops at that time, and every request not finished by then counts as
outside the SLO (as a measured run that cancels what is still in flight at its cap).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass

from tandem.planner.profile_model import LatencyLaws
from tandem.planner.sim_cores import CoreShare
from tandem.planner.sim_types import Layout, SimReport, SimSettings, SloTargets
from tandem.planner.sim_worker import SimSeq, SimWorker
from tandem.planner.workload import PlanRequest, PlanWorkload
from tandem.router.policy import (
    DecodeLatencyModel,
    GoodputPolicy,
    PlacementRequest,
    PrefillLatencyModel,
    PrefixIndex,
    RequestSlo,
    SelectorConfig,
    Slo,
    WorkerState,
)
from tandem.worker.config import WorkerRole

__all__ = ["ClusterSimulation", "Layout", "SimReport", "SimSettings", "SloTargets"]

_VOCAB = 30000


@dataclass(frozen=True)
class _Arrival:
    req_id: str
    request: PlanRequest


@dataclass(frozen=True)
class _StepEnd:
    worker: SimWorker
    # Which end time of the step this is (sharing cores moves a step's end; see `sim_cores`).
    version: int


@dataclass(frozen=True)
class _PullEnd:
    decode: SimWorker
    seq: SimSeq
    # The prefill worker that held the KV.
    source: str


_Event = _Arrival | _StepEnd | _PullEnd


class _Prompts:
    """Token ids per request: shared prefixes per group, unique random tails."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._prefixes: dict[int, list[int]] = {}

    def ids(self, request: PlanRequest) -> list[int]:
        shared = request.shared_prefix_tokens
        prefix = self._prefixes.setdefault(request.prefix_group, [])
        while len(prefix) < shared:
            prefix.append(self._rng.randrange(3, _VOCAB))
        tail = [self._rng.randrange(3, _VOCAB) for _ in range(request.prompt_tokens - shared)]
        return prefix[:shared] + tail


class ClusterSimulation:
    """One run: a layout, a workload at one rate, the SLOs."""

    def __init__(
        self,
        laws: LatencyLaws,
        settings: SimSettings,
        layout: Layout,
        slo: SloTargets,
    ) -> None:
        self.laws, self.settings, self.layout, self.slo = laws, settings, layout, slo
        limits = settings.limits
        roles = ([WorkerRole.PREFILL] * layout.num_prefill + [WorkerRole.DECODE] * layout.num_decode
                 + [WorkerRole.COLOCATED] * layout.num_colocated)  # fmt: skip
        self.workers = {
            f"{role.value}-{i}": SimWorker(f"{role.value}-{i}", role, laws, limits)
            for i, role in enumerate(roles)
        }
        states = {wid: self._state(w) for wid, w in self.workers.items()}
        self.now_s = 0.0
        self.policy = GoodputPolicy(
            [s for s in states.values() if s.role is WorkerRole.PREFILL],
            [s for s in states.values() if s.role is not WorkerRole.PREFILL],
            selector_config=SelectorConfig(
                max_local_prefill_tokens=settings.max_local_prefill_tokens,
                kv_transfer_s_per_token=laws.transfer_s_per_token,
            ),
            clock=lambda: self.now_s,
        )
        self.router_slo = RequestSlo(Slo(slo.ttft_s, slo.tpot_s), 0, "interactive")
        self.caches = {wid: PrefixIndex(limits.block_size, 1 << 30) for wid in self.workers}

    def _state(self, worker: SimWorker) -> WorkerState:
        pa, pb, pc = self.laws.router_prefill_coefficients()
        return WorkerState(
            worker.worker_id,
            worker.role,
            block_size=self.settings.limits.block_size,
            num_blocks=self.settings.limits.num_blocks,
            prefill_model=PrefillLatencyModel((pa, pb, pc)),
            decode_model=DecodeLatencyModel(self.laws.router_decode_coefficients()),
        )

    def run(
        self,
        workload: PlanWorkload,
        rate_rps: float,
        stop_below: float | None = None,
        num_requests: int | None = None,
        until_s: float | None = None,
    ) -> SimReport:
        """Serve `num_requests` of `workload` (default: all) at `rate_rps`; stop early
        (report.stopped_early) once the attainment can no longer reach `stop_below`;
        stop at `until_s` (from the first arrival), unfinished requests counted as missed."""
        arrivals = workload.arrivals_at(rate_rps, num_requests)
        report = SimReport(self.layout, rate_rps, len(arrivals))
        self._report = report
        max_missed = (
            math.inf
            if stop_below is None
            else math.floor((1 - stop_below) * report.num_requests + 1e-9)
        )
        self._events: list[tuple[float, int, _Event]] = []
        self._order = itertools.count()
        self._arrival: dict[str, float] = {}
        self._first_token: dict[str, float] = {}
        self._missed: set[str] = set()
        self._ttft_missed: set[str] = set()
        # Per decode worker: prefilled requests waiting for blocks (request, source, since).
        self._pulls: dict[str, list[tuple[SimSeq, str, float]]] = {w: [] for w in self.workers}
        prompts = _Prompts(self.settings.seed)
        share_prefixes = any(r.shared_prefix_tokens for r in workload.requests)
        # TTFT deadlines of requests without a first token yet (misses found early).
        deadlines: list[tuple[float, str]] = []
        for i, (req, t) in enumerate(arrivals):
            self._push(t, _Arrival(f"r{i}", req))
        self._done: set[str] = set()
        self._cores = CoreShare(self.settings.shared_cores, self.settings.threads_per_worker)
        self._versions = dict.fromkeys(self.workers, 0)
        while self._events:
            if until_s is not None and self._events[0][0] > until_s:
                cut = {f"r{i}" for i in range(len(arrivals))} - self._done
                report.num_cut = len(cut)
                self._missed |= cut
                self._ttft_missed |= cut - self._first_token.keys()
                break
            self.now_s, _, event = heapq.heappop(self._events)
            while deadlines and deadlines[0][0] < self.now_s:
                _, req_id = heapq.heappop(deadlines)
                if req_id not in self._first_token:
                    self._missed.add(req_id)
                    self._ttft_missed.add(req_id)
            if len(self._missed) > max_missed:
                report.stopped_early = True
                break
            if isinstance(event, _Arrival):
                req_id, req = event.req_id, event.request
                ids = prompts.ids(req)
                self._arrival[req_id] = self.now_s
                heapq.heappush(deadlines, (self.now_s + self.slo.ttft_s, req_id))
                placement = self.policy.place_now(
                    PlacementRequest(req_id, ids, req.output_tokens, self.router_slo)
                )
                report.decisions[placement.decision] += 1
                wid = placement.prefill_worker_id or placement.decode_worker_id
                cached = 0
                if share_prefixes:
                    cached = self.caches[wid].match_len(ids, placement.prompt_hashes)
                    self.caches[wid].insert(ids, hashes=placement.prompt_hashes)
                self.workers[wid].add_prompt(SimSeq(req_id, len(ids), req.output_tokens, cached))
                self._kick(self.workers[wid])
            elif isinstance(event, _StepEnd):
                if event.version == self._versions[event.worker.worker_id]:
                    self._step_done(event.worker)
            else:
                decode, seq, source = event.decode, event.seq, event.source
                self.policy.on_kv_pulled(seq.req_id)
                self.workers[source].release(seq.req_id)
                self._kick(self.workers[source])
                decode.join_batch(seq)
                if seq.output_tokens <= 1:
                    decode.num_free_blocks += seq.num_blocks
                    decode.running.remove(seq)
                    self._finished(seq)
                self._kick(decode)
        report.num_missed = len(self._missed)
        report.num_ttft_missed = len(self._ttft_missed)
        report.num_tpot_missed = len(self._missed - self._ttft_missed)
        return report

    def _push(self, t: float, event: _Event) -> None:
        heapq.heappush(self._events, (t, next(self._order), event))

    def _kick(self, worker: SimWorker) -> None:
        if not worker.busy:
            end = worker.start_step(self.now_s)
            if end is None:
                return
            if not self._cores.shared:
                self._push(end, _StepEnd(worker, 0))
                return
            self._move_ends(self._cores.start(self.now_s, worker.worker_id, end - self.now_s))

    def _move_ends(self, ends: dict[str, float]) -> None:
        """New end times of the steps in flight (older end events become stale)."""
        for wid, end in ends.items():
            self._versions[wid] += 1
            self._push(end, _StepEnd(self.workers[wid], self._versions[wid]))

    def _step_done(self, worker: SimWorker) -> None:
        if self._cores.shared:
            self._move_ends(self._cores.finish(self.now_s, worker.worker_id))
        result = worker.finish_step()
        for seq in result.first_tokens:
            if seq.req_id in self._first_token:
                continue  # recomputed after an expired lease: token 1 was already out
            ttft = self.now_s - self._arrival[seq.req_id]
            self._report.ttft_s.append(ttft)
            self._first_token[seq.req_id] = self.now_s
            if ttft > self.slo.ttft_s:
                self._missed.add(seq.req_id)
                self._ttft_missed.add(seq.req_id)
            self.policy.on_prefill_done(seq.req_id, num_cached_tokens=seq.cached_tokens)
            if worker.role is WorkerRole.PREFILL:
                placement = self.policy.placement_of(seq.req_id)
                assert placement is not None
                decode_id = placement.decode_worker_id
                self._pulls[decode_id].append((seq, worker.worker_id, self.now_s))
                self._admit_pulls(self.workers[decode_id])
        for seq in result.finished:
            self._finished(seq)
        self._kick(worker)
        if worker.role is not WorkerRole.PREFILL and self._pulls[worker.worker_id]:
            self._admit_pulls(worker)

    def _admit_pulls(self, decode: SimWorker) -> None:
        """Pull-based admission: start each waiting pull in order while blocks are free."""
        queue = self._pulls[decode.worker_id]
        while queue:
            seq, source, since = queue[0]
            if self.now_s - since > self.settings.kv_lease_s:
                # The lease expired unpulled: the prefill side frees the blocks and the
                # decode worker recomputes the prompt itself.
                queue.pop(0)
                self.workers[source].release(seq.req_id)
                self._kick(self.workers[source])
                decode.add_prompt(SimSeq(seq.req_id, seq.prompt_tokens, seq.output_tokens))
                continue
            copy = SimSeq(seq.req_id, seq.prompt_tokens, seq.output_tokens)
            if not decode.try_import(copy):
                break
            queue.pop(0)
            pulled_at = self.now_s + self.laws.transfer_s(seq.prompt_tokens)
            self._push(pulled_at, _PullEnd(decode, copy, source))
        self._kick(decode)

    def _finished(self, seq: SimSeq) -> None:
        self.policy.on_finish(seq.req_id)
        self._done.add(seq.req_id)
        first = self._first_token[seq.req_id]
        tpot = (self.now_s - first) / (seq.output_tokens - 1) if seq.output_tokens > 1 else 0.0
        self._report.tpot_s.append(tpot)
        if tpot > self.slo.tpot_s:
            self._missed.add(seq.req_id)
        if seq.req_id not in self._missed:
            self._report.num_met += 1
