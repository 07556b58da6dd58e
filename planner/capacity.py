"""Steady-state throughput bounds of a layout, from the latency laws alone.

A finite simulation can absorb a burst that no cluster could sustain (a few hundred
requests fit in the batches and finish within a generous TPOT target), so the search
never credits a layout with more than its pools can serve in steady state:

- a prefill worker runs full token-budget steps: `k` short prompts per step, or one
  long prompt in `ceil(u / budget)` chunks (`u`: uncached prompt tokens);
- a decode worker runs its largest batch (`max_num_seqs`, or what its KV blocks hold)
  for `osl - 1` steps per request;
- a colocated worker does both, one after the other.
"""

from __future__ import annotations

import math

from tandem.planner.profile_format import EngineLimits
from tandem.planner.profile_model import LatencyLaws
from tandem.planner.simulator import Layout
from tandem.planner.workload import PlanWorkload


def prefill_rps(laws: LatencyLaws, limits: EngineLimits, uncached_tokens: float) -> float:
    """Prompts per second one worker prefills at full budget."""
    u = max(1, round(uncached_tokens))
    budget = limits.max_num_batched_tokens
    if u <= budget:
        per_step = max(1, min(budget // u, limits.max_num_seqs))
        step = laws.step_s([(u, 0)] * per_step, 0, 0)
        return per_step / step if step > 0 else math.inf
    chunks = math.ceil(u / budget)
    total = sum(laws.prefill_s(min(budget, u - i * budget), i * budget) for i in range(chunks))
    return 1 / total if total > 0 else math.inf


def decode_rps(
    laws: LatencyLaws, limits: EngineLimits, prompt_tokens: float, output_tokens: float
) -> float:
    """Requests per second one worker decodes with its largest batch."""
    if output_tokens <= 1:
        return math.inf
    per_request = math.ceil((prompt_tokens + output_tokens) / limits.block_size)
    batch = max(1, min(limits.max_num_seqs, limits.num_blocks // max(1, per_request)))
    step = laws.decode_s(batch, round(batch * (prompt_tokens + output_tokens / 2)))
    return batch / (step * (output_tokens - 1)) if step > 0 else math.inf


def throughput_bound(
    laws: LatencyLaws,
    limits: EngineLimits,
    layout: Layout,
    workload: PlanWorkload,
    max_local_prefill_tokens: int = 0,
) -> tuple[float, str]:
    """The layout's steady-state requests/s and the pool that limits it.

    Requests whose uncached prompt is at most `max_local_prefill_tokens` may be prefilled
    on a decode worker instead (conditional disaggregation; the router decides per
    request), which moves work from the prefill pool to the decode pool. The bound is the
    best that moving can do (an upper bound, as a cap on the search must be)."""
    isl, osl = workload.mean_prompt_tokens, workload.mean_output_tokens
    shared = sum(r.shared_prefix_tokens for r in workload.requests) / len(workload.requests)
    p = prefill_rps(laws, limits, isl - shared)
    d = decode_rps(laws, limits, isl, osl)
    if layout.num_colocated:
        return layout.num_colocated / (1 / p + 1 / d), "colocated workers'"
    local = sum(
        r.prompt_tokens - r.shared_prefix_tokens <= max_local_prefill_tokens
        for r in workload.requests
    ) / len(workload.requests)
    prefill_pool, decode_pool = layout.num_prefill * p, layout.num_decode * d
    if prefill_pool >= decode_pool or local == 0 or math.isinf(p):
        # Moving prefill onto the decode pool cannot help.
        if prefill_pool <= decode_pool:
            return prefill_pool, "prefill pool's"
        return decode_pool, "decode pool's"
    # A share f of requests prefilled on decode workers: the prefill pool takes
    # prefill_pool / (1 - f) requests/s, the decode pool num_decode / (1/d + f/p). The
    # first grows with f, the second falls: the best f is where they meet, or `local`.
    meet = (layout.num_decode - prefill_pool / d) / (prefill_pool / p + layout.num_decode)
    share = min(local, max(0.0, meet))
    if share >= 1.0:
        return layout.num_decode / (1 / d + 1 / p), "decode pool's"
    with_share = prefill_pool / (1 - share)
    return with_share, "prefill pool's" if share < local else "decode pool's"
