"""The requests a plan simulates: lengths, shared prefixes and arrival times at any rate.

A `PlanWorkload` holds a fixed list of requests and their arrival times at the
workload's *native* rate; `arrivals_at(rate)` stretches or squeezes the same arrival
pattern to another mean rate, so every rate the search tries sees the same requests
(a trace keeps its burstiness; a synthetic workload is Poisson).

Synthetic lengths are normal around `--isl` / `--osl` with the given standard
deviations, clipped to at least one token and to the model length. With a prefix
share `s`, the first `s·isl` tokens of each prompt are one of `num_prefixes` shared
prefixes (a system prompt, a document asked about twice), so the prefix cache hits.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.planner.traces import Trace


@dataclass(frozen=True)
class PlanRequest:
    prompt_tokens: int
    output_tokens: int
    # Leading prompt tokens shared with every request of the same `prefix_group`.
    shared_prefix_tokens: int = 0
    prefix_group: int = 0


@dataclass(frozen=True)
class PlanWorkload:
    name: str
    requests: tuple[PlanRequest, ...]
    # Arrival of each request at the native rate, seconds from the first (sorted).
    arrivals_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError("a workload needs at least one request")
        if len(self.arrivals_s) != len(self.requests):
            raise ValueError("one arrival time per request")

    @property
    def native_rate_rps(self) -> float:
        span = self.arrivals_s[-1] - self.arrivals_s[0]
        return (len(self.arrivals_s) - 1) / span if span > 0 else math.inf

    def arrivals_at(
        self, rate_rps: float, num_requests: int | None = None
    ) -> list[tuple[PlanRequest, float]]:
        """`num_requests` (default: all) requests with the arrival pattern scaled to a mean
        rate of `rate_rps`; past the end, the workload repeats (its pattern shifted)."""
        if not rate_rps > 0:
            raise ValueError(f"rate must be > 0, got {rate_rps}")
        count = len(self.requests) if num_requests is None else num_requests
        native = self.native_rate_rps
        scale = 0.0 if math.isinf(native) else native / rate_rps
        # One repeat starts one mean gap after the previous one ended.
        period = 0.0 if math.isinf(native) else self.arrivals_s[-1] + 1 / native
        size = len(self.requests)
        return [
            (self.requests[i % size], (self.arrivals_s[i % size] + (i // size) * period) * scale)
            for i in range(count)
        ]

    @property
    def mean_prompt_tokens(self) -> float:
        return sum(r.prompt_tokens for r in self.requests) / len(self.requests)

    @property
    def mean_output_tokens(self) -> float:
        return sum(r.output_tokens for r in self.requests) / len(self.requests)


def synthetic_workload(
    isl: float,
    osl: float,
    *,
    isl_std: float = 0.0,
    osl_std: float = 0.0,
    num_requests: int = 300,
    max_model_len: int | None = None,
    prefix_share: float = 0.0,
    num_prefixes: int = 8,
    seed: int = 0,
) -> PlanWorkload:
    """Poisson arrivals (rate 1) of requests with normally distributed lengths."""
    if isl < 1 or osl < 1:
        raise ValueError(f"isl and osl must be >= 1, got {isl} and {osl}")
    if isl_std < 0 or osl_std < 0:
        raise ValueError("isl_std and osl_std must be >= 0")
    if not 0 <= prefix_share < 1:
        raise ValueError(f"prefix_share must be in [0, 1), got {prefix_share}")
    if num_requests < 1 or num_prefixes < 1:
        raise ValueError("num_requests and num_prefixes must be >= 1")
    rng = random.Random(seed)
    limit = max_model_len or 1 << 30
    shared = int(prefix_share * isl)
    requests, arrivals, t = [], [], 0.0
    for _ in range(num_requests):
        output = _draw(rng, osl, osl_std, 1, limit - 1)
        prompt = _draw(rng, isl, isl_std, max(1, shared + 1), limit - output)
        group = rng.randrange(num_prefixes)
        requests.append(PlanRequest(prompt, output, min(shared, prompt - 1), group))
        arrivals.append(t)
        t += rng.expovariate(1.0)
    name = f"isl {isl:g}±{isl_std:g}, osl {osl:g}±{osl_std:g}"
    return PlanWorkload(name, tuple(requests), tuple(arrivals))


def trace_workload(trace: Trace, max_model_len: int | None = None) -> PlanWorkload:
    """A trace's requests (lengths clipped to the model length) at its own arrival times."""
    limit = max_model_len or 1 << 30
    requests = []
    for r in trace.requests:
        output = max(1, min(r.output_tokens, limit - 1))
        requests.append(PlanRequest(max(1, min(r.prompt_tokens, limit - output)), output))
    return PlanWorkload(trace.path, tuple(requests), tuple(r.arrival_s for r in trace.requests))


def observed_workload(
    prompt_lens: Sequence[int], output_lens: Sequence[int], prefix_share: float, seed: int = 0
) -> PlanWorkload:
    """Requests as a live router saw them (their lengths), arriving Poisson at rate 1."""
    rng = random.Random(seed)
    requests, arrivals, t = [], [], 0.0
    for prompt, output in zip(prompt_lens, output_lens, strict=True):
        shared = min(prompt - 1, int(prefix_share * prompt))
        requests.append(PlanRequest(max(1, prompt), max(1, output), max(0, shared)))
        arrivals.append(t)
        t += rng.expovariate(1.0)
    return PlanWorkload("observed", tuple(requests), tuple(arrivals))


def _draw(rng: random.Random, mean: float, std: float, low: int, high: int) -> int:
    value = rng.gauss(mean, std) if std > 0 else mean
    return int(min(max(round(value), low), max(low, high)))
