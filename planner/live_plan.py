"""One live plan, from observed traffic and the router's latency models (runs in a
separate process so the search never stalls the router's event loop)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from dataclasses import dataclass

from tandem.planner.hysteresis import Split
from tandem.planner.observe import ObservedLoad
from tandem.planner.profile_format import EngineLimits
from tandem.planner.profile_model import LatencyLaws
from tandem.planner.search import max_goodput, plan
from tandem.planner.simulator import ClusterSimulation, Layout, SimSettings, SloTargets
from tandem.planner.workload import synthetic_workload

# prctl(2): the signal this process gets when its parent exits.
_PR_SET_PDEATHSIG = 1
# Spread of the synthetic lengths around the observed means (the router counts means only).
_LENGTH_SPREAD = 0.25


@dataclass(frozen=True)
class LivePlanInput:
    laws: LatencyLaws
    limits: EngineLimits
    budget: int
    slo: SloTargets
    load: ObservedLoad
    # The pools' split now (None: colocated or unknown).
    current: Split | None
    max_local_prefill_tokens: int
    num_requests: int
    seed: int = 0
    # The current split stays recommended unless another one's goodput beats it by more
    # than this fraction (near-ties must not flip the recommendation on noise).
    min_gain: float = 0.0
    # The most workers the pools take of one role (splits beyond it are not searched).
    max_per_role: int | None = None


@dataclass(frozen=True)
class LivePlanResult:
    recommended: Split
    reason: str
    # Goodput (req/s within SLO) the search found per split, the current one included.
    goodput: dict[Split, float]
    # The recommendation's goodput at the observed arrival rate.
    predicted_goodput_rps: float


def compute_plan(given: LivePlanInput) -> LivePlanResult:
    load = given.load
    workload = synthetic_workload(
        max(1.0, load.mean_prompt_tokens),
        max(1.0, load.mean_output_tokens),
        isl_std=_LENGTH_SPREAD * load.mean_prompt_tokens,
        osl_std=_LENGTH_SPREAD * load.mean_output_tokens,
        num_requests=given.num_requests,
        max_model_len=given.limits.max_model_len,
        prefix_share=min(load.prefix_hit_share, 0.9),
        seed=given.seed,
    )
    settings = SimSettings(given.limits, max_local_prefill_tokens=given.max_local_prefill_tokens)
    result = plan(
        given.laws, settings, given.budget, given.slo, workload, max_per_role=given.max_per_role
    )
    goodput = {(s.layout.num_prefill, s.layout.num_decode): s.goodput_rps for s in result.splits}
    if given.current is not None and given.current not in goodput:
        layout = Layout(*given.current)
        now = max_goodput(given.laws, settings, layout, given.slo, workload)
        goodput[given.current] = now.goodput_rps
    best = result.recommended.layout
    recommended, why = (best.num_prefill, best.num_decode), result.reason
    if _allowed(given.current, given) and recommended != given.current:
        assert given.current is not None
        kept = goodput[given.current]
        if goodput[recommended] <= kept * (1 + given.min_gain):
            why = (
                f"keeps {given.current[0]}P+{given.current[1]}D ({kept:.3g} req/s): the best "
                f"split {recommended[0]}P+{recommended[1]}D ({goodput[recommended]:.3g} req/s) "
                f"gains no more than {given.min_gain:.0%}"
            )
            recommended = given.current
    predicted = 0.0
    if load.arrival_rate_rps > 0:
        sim = ClusterSimulation(given.laws, settings, Layout(*recommended), given.slo)
        predicted = sim.run(workload, load.arrival_rate_rps).goodput_rps
    return LivePlanResult(recommended, why, goodput, predicted)


def _allowed(split: Split | None, given: LivePlanInput) -> bool:
    """Whether the pools may stay at `split`: within the budget and the per-role limit
    (pools scaled past them by hand are brought back, not kept)."""
    if split is None or sum(split) > given.budget:
        return False
    return given.max_per_role is None or max(split) <= given.max_per_role


def init_planning_process(parent_pid: int) -> None:
    """The planner process's initializer. It ignores Ctrl-C: a terminal sends it to the
    whole process group, and the serving process that owns this one shuts it down (no
    traceback). On Linux it dies with that process (SIGKILL'd by the kernel when its
    parent goes): a `tandem serve` killed outright (-9, out of memory) left it running,
    240 MB, forever."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent went before the request took
            os._exit(0)


def warm_up() -> int:
    """Run once in the planner's process at start, so its imports are done before the
    first interval's plan; returns the process's pid (for its owner to kill it by)."""
    return os.getpid()
