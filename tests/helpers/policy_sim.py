"""A tiny discrete-event simulation of prefill workers for policy tests (no servers).

Each simulated worker is a FIFO server with its own *true* prefix cache and a true
latency law; the policy under test only sees what `RequestFlow` would tell it
(placements it made, first tokens with cached counts and compute times, finishes).
Decode is instantaneous: these simulations study prefill placement and TTFT.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tandem.router.errors import Overloaded
from tandem.router.policy import GoodputPolicy, Placement, PlacementRequest, PrefixIndex, RequestSlo
from tests.helpers.clock import FakeClock


@dataclass
class SimRequest:
    req_id: str
    prompt_ids: list[int]
    arrival_s: float
    slo: RequestSlo
    max_tokens: int = 16


@dataclass
class SimResult:
    request: SimRequest
    # None when admission shed the request.
    placement: Placement | None
    # Worker that prefilled it.
    worker_id: str | None = None
    ttft_s: float | None = None
    # Prompt tokens the worker's true cache served.
    cached_tokens: int = 0


@dataclass
class SimWorker:
    worker_id: str
    law: Callable[[int], float]
    block_size: int
    cache: PrefixIndex = field(init=False)
    queue: list[tuple[SimRequest, SimResult]] = field(default_factory=list)
    busy: bool = False
    busy_s: float = 0.0

    def __post_init__(self) -> None:
        self.cache = PrefixIndex(self.block_size, capacity_blocks=1 << 20)


def simulate(
    policy: GoodputPolicy,
    clock: FakeClock,
    requests: Sequence[SimRequest],
    laws: dict[str, Callable[[int], float]],
    *,
    block_size: int,
    noise: float = 0.0,
    seed: int = 0,
    warm: dict[str, list[list[int]]] | None = None,
) -> tuple[list[SimResult], dict[str, SimWorker]]:
    """Run `requests` through `policy` on workers following `laws`; results in order.

    `warm` pre-fills workers' true caches (worker id -> prompts).
    """
    rng = random.Random(seed)
    workers = {wid: SimWorker(wid, law, block_size) for wid, law in laws.items()}
    for wid, prompts in (warm or {}).items():
        for prompt in prompts:
            workers[wid].cache.insert(prompt)
    events: list[tuple[float, int, str, object]] = []
    seq = itertools.count()
    for req in requests:
        heapq.heappush(events, (req.arrival_s, next(seq), "arrive", req))
    results: list[SimResult] = []

    def start(worker: SimWorker) -> None:
        if worker.busy or not worker.queue:
            return
        req, result = worker.queue.pop(0)
        hashes = result.placement.prompt_hashes if result.placement else None
        cached = worker.cache.match_len(req.prompt_ids, hashes)
        worker.cache.insert(req.prompt_ids, hashes=hashes)
        compute = worker.law(len(req.prompt_ids) - cached) * rng.uniform(1 - noise, 1 + noise)
        result.cached_tokens = cached
        worker.busy = True
        worker.busy_s += compute
        heapq.heappush(events, (clock.now + compute, next(seq), "done", (worker, result, compute)))

    while events:
        clock.now, _, kind, data = heapq.heappop(events)
        if kind == "arrive":
            req = data
            assert isinstance(req, SimRequest)
            try:
                placement = policy.place_now(
                    PlacementRequest(req.req_id, req.prompt_ids, req.max_tokens, req.slo)
                )
            except Overloaded:
                results.append(SimResult(req, None))
                continue
            result = SimResult(req, placement)
            results.append(result)
            worker = workers[placement.prefill_worker_id or placement.decode_worker_id]
            result.worker_id = worker.worker_id
            worker.queue.append((req, result))
            start(worker)
        else:
            worker, result, compute = data  # type: ignore[misc]
            worker.busy = False
            req = result.request
            result.ttft_s = clock.now - req.arrival_s
            policy.on_prefill_done(
                req.req_id, num_cached_tokens=result.cached_tokens, compute_s=compute
            )
            policy.on_kv_pulled(req.req_id)
            policy.on_finish(req.req_id)
            start(worker)
    return results, workers


def poisson_arrivals(num: int, rate_per_s: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(num):
        t += rng.expovariate(rate_per_s)
        times.append(t)
    return times
