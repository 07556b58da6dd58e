"""What the live planner sees of the traffic: deltas of the router's own counters.

Each interval it reads the router's Prometheus registry (requests that got a first
token, prompt and generated tokens, finished requests, those within SLO, those
admission shed) and the policy's reported prefix-cache hits, and turns the change since
the last reading into an `ObservedLoad`: arrival rate (shed requests included),
mean prompt and output lengths, prefix-hit share, goodput.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

if TYPE_CHECKING:
    from tandem.router.server import Router


@dataclass(frozen=True)
class Counters:
    """Running totals of one router (or, summed, of every router of a cluster)."""

    first_tokens: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    finished: float = 0.0
    goodput: float = 0.0
    cached_tokens: float = 0.0
    # Requests admission shed (overloaded): demand the split did not serve.
    shed: float = 0.0

    def __add__(self, other: Counters) -> Counters:
        return Counters(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass(frozen=True)
class ObservedLoad:
    interval_s: float
    num_requests: int
    # Requests that finished (the output length is measured over these).
    num_finished: int
    # Requests that got a first token, and those shed, per second.
    arrival_rate_rps: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    # Share of prompt tokens the prefix caches served.
    prefix_hit_share: float
    goodput_rps: float


def _total(registry: CollectorRegistry, sample_name: str, **labels: str) -> float:
    """Sum of one sample name over the label sets that have `labels`."""
    total = 0.0
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name == sample_name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def read_router_counters(router: Router) -> Counters:
    """A serving router's totals (its metrics and its policy's reported cache hits)."""
    runtime = router.policy_runtime
    if runtime is None or runtime.policy is None or router.metrics is None:
        raise RuntimeError("the router is not serving")
    return read_counters(router.metrics.registry, runtime.policy.num_reported_cached_tokens)


def read_counters(registry: CollectorRegistry, cached_tokens: float) -> Counters:
    return Counters(
        first_tokens=_total(registry, "tandem:time_to_first_token_seconds_count"),
        prompt_tokens=_total(registry, "tandem:prompt_tokens_total"),
        generation_tokens=_total(registry, "tandem:generation_tokens_total"),
        finished=_total(registry, "tandem:request_success_total"),
        goodput=_total(registry, "tandem:goodput_requests_total"),
        cached_tokens=cached_tokens,
        shed=_total(registry, "tandem:requests_rejected_total", reason="overloaded"),
    )


def load_between(before: Counters, after: Counters, interval_s: float) -> ObservedLoad:
    """The traffic between two readings `interval_s` apart."""
    started = after.first_tokens - before.first_tokens
    finished = after.finished - before.finished
    prompt = after.prompt_tokens - before.prompt_tokens
    generated = after.generation_tokens - before.generation_tokens
    cached = after.cached_tokens - before.cached_tokens
    shed = after.shed - before.shed
    return ObservedLoad(
        interval_s=interval_s,
        num_requests=int(started),
        num_finished=int(finished),
        # Shed requests arrived too: a split that served them is what the plan is for
        # (counting only those served, an overloaded cluster looked just busy enough).
        arrival_rate_rps=(started + shed) / interval_s,
        mean_prompt_tokens=prompt / started if started > 0 else 0.0,
        mean_output_tokens=generated / finished if finished > 0 else 0.0,
        prefix_hit_share=min(0.95, max(0.0, cached / prompt)) if prompt > 0 else 0.0,
        goodput_rps=(after.goodput - before.goodput) / interval_s,
    )
