"""The simulator against closed forms: an M/D/1 queue, lone requests, the KV pull."""

from __future__ import annotations

import pytest

from tandem.planner.profile_format import EngineLimits
from tandem.planner.profile_model import LatencyLaws
from tandem.planner.sim_cores import CoreShare
from tandem.planner.simulator import ClusterSimulation, Layout, SimSettings, SloTargets
from tandem.planner.workload import PlanRequest, PlanWorkload, synthetic_workload

LOOSE = SloTargets(ttft_s=1e6, tpot_s=1e6)


def laws(prefill_s=0.0, per_token=0.0, decode_s=0.0, transfer_s_per_token=0.0) -> LatencyLaws:
    return LatencyLaws(prefill_s, per_token, 0.0, decode_s, 0.0, 0.0, 0.0, transfer_s_per_token)


def settings(budget: int, max_num_seqs: int = 64, local: int = 0) -> SimSettings:
    limits = EngineLimits(16, budget, max_num_seqs, 100_000, 1 << 20)
    return SimSettings(limits, max_local_prefill_tokens=local)


def spaced(requests: list[PlanRequest], gap_s: float) -> PlanWorkload:
    return PlanWorkload("spaced", tuple(requests), tuple(i * gap_s for i in range(len(requests))))


def test_one_worker_fixed_service_time_is_md1():
    """Poisson arrivals, deterministic service D, one server: mean wait = ρD / (2(1 − ρ))."""
    service_s, rho = 0.01, 0.6
    # A 16-token prompt fills the 16-token budget: one request per step, 1 output token.
    workload = synthetic_workload(16, 1, num_requests=6000, seed=3)
    sim = ClusterSimulation(laws(prefill_s=service_s), settings(16), Layout(num_colocated=1), LOOSE)
    report = sim.run(workload, rate_rps=rho / service_s)
    mean_wait = sum(report.ttft_s) / len(report.ttft_s) - service_s
    assert mean_wait == pytest.approx(rho * service_s / (2 * (1 - rho)), rel=0.1)
    assert report.attainment == 1.0


def test_lone_requests_never_fill_a_batch():
    """Arrivals further apart than a request's life: TTFT = prefill, TPOT = one step."""
    law = laws(prefill_s=0.02, per_token=1e-4, decode_s=0.005)
    requests = [PlanRequest(100, 11), PlanRequest(300, 6)]
    sim = ClusterSimulation(law, settings(512), Layout(num_colocated=1), LOOSE)
    report = sim.run(spaced(requests, 10.0), rate_rps=0.1)
    assert report.ttft_s == pytest.approx([law.prefill_s(100), law.prefill_s(300)])
    assert report.tpot_s == pytest.approx([0.005, 0.005])


def test_chunked_prefill_splits_a_prompt_into_budget_sized_steps():
    law = laws(prefill_s=0.01, per_token=1e-4)
    sim = ClusterSimulation(law, settings(256), Layout(num_colocated=1), LOOSE)
    report = sim.run(spaced([PlanRequest(1000, 1)], 1.0), rate_rps=1.0)
    # ceil(1000 / 256) = 4 steps, each paying the fixed cost once.
    assert report.ttft_s == pytest.approx([4 * 0.01 + 1000 * 1e-4])


def test_disaggregated_request_pays_the_kv_transfer_before_its_second_token():
    law = laws(prefill_s=0.05, decode_s=0.01, transfer_s_per_token=1e-4)
    sim = ClusterSimulation(law, settings(512), Layout(1, 1), LOOSE)
    report = sim.run(spaced([PlanRequest(200, 11)], 1.0), rate_rps=1.0)
    assert report.decisions["disaggregated"] == 1
    assert report.ttft_s == pytest.approx([0.05])
    # Token 2 waits for the pull (200 tokens) and one decode step; 9 more steps follow.
    assert report.tpot_s == pytest.approx([(200 * 1e-4 + 10 * 0.01) / 10])


def test_short_prompt_is_prefilled_on_the_decode_worker():
    law = laws(prefill_s=0.05, decode_s=0.01, transfer_s_per_token=1e-4)
    sim = ClusterSimulation(law, settings(512, local=512), Layout(1, 1), LOOSE)
    report = sim.run(spaced([PlanRequest(32, 5)], 1.0), rate_rps=1.0)
    assert report.decisions["local_prefill"] == 1
    assert report.tpot_s == pytest.approx([0.01])


def test_a_batch_limit_queues_decodes():
    """max_num_seqs = 1: requests arriving together run one after another."""
    law = laws(prefill_s=0.0, per_token=1e-6, decode_s=0.01)
    requests = [PlanRequest(16, 10)] * 3
    wl = PlanWorkload("burst", tuple(requests), (0.0, 0.0, 0.0))
    sim = ClusterSimulation(law, settings(512, max_num_seqs=1), Layout(num_colocated=1), LOOSE)
    report = sim.run(wl, rate_rps=1.0)
    assert sorted(report.ttft_s) == pytest.approx([16e-6, 0.09 + 32e-6, 0.18 + 48e-6], abs=1e-3)


def test_early_stop_when_the_target_is_out_of_reach():
    law = laws(prefill_s=0.1)
    wl = synthetic_workload(16, 1, num_requests=500)
    sim = ClusterSimulation(law, settings(16), Layout(num_colocated=1), SloTargets(0.2, 1.0))
    report = sim.run(wl, rate_rps=100.0, stop_below=0.9)
    assert report.stopped_early
    assert report.attainment < 0.9


def test_shared_prefixes_hit_the_prefix_cache():
    """Requests sharing a long prefix prefill only their own tail after the first."""
    law = laws(prefill_s=0.01, per_token=1e-4)
    shared = [PlanRequest(512, 1, shared_prefix_tokens=480, prefix_group=0)] * 3
    fresh = [PlanRequest(512, 1)] * 3
    runs = {}
    for name, requests in (("shared", shared), ("fresh", fresh)):
        sim = ClusterSimulation(law, settings(512), Layout(num_colocated=1), LOOSE)
        runs[name] = sim.run(spaced(requests, 1.0), rate_rps=1.0).ttft_s
    assert runs["fresh"] == pytest.approx([law.prefill_s(512)] * 3)
    assert runs["shared"][0] == pytest.approx(law.prefill_s(512))
    # 480 tokens = 30 full blocks cached: only the last 32 are computed.
    assert runs["shared"][1:] == pytest.approx([law.prefill_s(32, 480)] * 2)


def test_workers_sharing_one_core_step_at_half_speed():
    """Two colocated workers, each prefilling at once: on one shared core each step takes
    twice its time alone (processor sharing); on their own devices, its time alone."""
    law = laws(prefill_s=0.1)
    wl = PlanWorkload("pair", (PlanRequest(16, 1),) * 2, (0.0, 0.0))
    ttfts = {}
    for cores in (None, 1.0):
        limits = settings(512).limits
        shared = SimSettings(limits, max_local_prefill_tokens=0, shared_cores=cores)
        sim = ClusterSimulation(law, shared, Layout(num_colocated=2), LOOSE)
        ttfts[cores] = sim.run(wl, rate_rps=1.0).ttft_s
    assert ttfts[None] == pytest.approx([0.1, 0.1])
    assert ttfts[1.0] == pytest.approx([0.2, 0.2])


def test_core_share_speeds_up_when_a_step_ends():
    cores = CoreShare(2.0, threads_per_worker=2)
    assert cores.start(0.0, "a", 1.0) == {"a": 1.0}
    # Two 2-thread workers on 2 cores: half speed each; "a" has 0.5 s of work left at 0.5.
    assert cores.start(0.5, "b", 1.0) == pytest.approx({"a": 1.5, "b": 2.5})
    assert cores.finish(1.5, "a") == pytest.approx({"b": 2.0})


def test_a_run_cut_at_until_s_counts_unfinished_requests_as_missed():
    law = laws(prefill_s=0.01, decode_s=0.1)
    requests = [PlanRequest(16, 2), PlanRequest(16, 100)]
    sim = ClusterSimulation(law, settings(512), Layout(num_colocated=1), LOOSE)
    report = sim.run(spaced(requests, 1.0), rate_rps=1.0, until_s=5.0)
    assert report.num_cut == 1
    assert report.num_met == 1
    assert report.attainment == 0.5
