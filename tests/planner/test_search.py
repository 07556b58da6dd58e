"""The search and its recommendation: fitted laws, and the split follows the workload."""

from __future__ import annotations

import pytest

from tandem.planner.profile_format import load_profile
from tandem.planner.profile_model import LatencyLaws
from tandem.planner.search import layouts, plan
from tandem.planner.simulator import SimSettings, SloTargets
from tandem.planner.workload import synthetic_workload
from tests.helpers.planner_profile import DECODE, PREFILL, TRANSFER, write_profile


@pytest.fixture
def profile(tmp_path):
    return load_profile(write_profile(tmp_path / "profile.json"))


def test_fit_recovers_the_laws_the_samples_came_from(profile):
    laws = LatencyLaws.fit(profile)
    got = (laws.prefill_fixed_s, laws.prefill_per_token_s, laws.prefill_per_pair_s)
    assert got == pytest.approx(PREFILL, rel=1e-3)
    got = (laws.decode_fixed_s, laws.decode_per_seq_s, laws.decode_per_context_token_s)
    assert got == pytest.approx(DECODE, rel=1e-3)
    assert (laws.transfer_fixed_s, laws.transfer_s_per_token) == pytest.approx(TRANSFER, rel=1e-3)
    # Chunked or whole, a prompt's attention costs the same.
    whole = laws.prefill_s(1024) - laws.prefill_fixed_s
    halves = laws.prefill_s(512) + laws.prefill_s(512, 512) - 2 * laws.prefill_fixed_s
    assert halves == pytest.approx(whole)


def test_layouts_keep_each_role_within_the_pools_limit():
    """The pool controller refuses a role over its per-role limit: no such split is searched."""
    splits, _ = layouts(8, max_per_role=5)
    assert [(s.num_prefill, s.num_decode) for s in splits] == [(3, 5), (4, 4), (5, 3)]
    with pytest.raises(ValueError, match="no split with at most 3 per role"):
        layouts(8, max_per_role=3)


def test_layouts_cover_every_split_and_refuse_a_budget_below_two():
    splits, colocated = layouts(4)
    assert [(s.num_prefill, s.num_decode) for s in splits] == [(1, 3), (2, 2), (3, 1)]
    assert colocated.num_colocated == 4
    with pytest.raises(ValueError, match="budget"):
        layouts(1)


@pytest.mark.timeout(120)
def test_prompt_heavy_gets_more_prefill_than_decode_heavy(profile):
    laws, settings = LatencyLaws.fit(profile), SimSettings(profile.engine)
    slo = SloTargets(ttft_s=1.0, tpot_s=0.05)
    budget = 3
    prompt_heavy = synthetic_workload(1500, 16, isl_std=200, osl_std=4, num_requests=80)
    decode_heavy = synthetic_workload(64, 300, isl_std=16, osl_std=50, num_requests=80)
    heavy = plan(laws, settings, budget, slo, prompt_heavy)
    light = plan(laws, settings, budget, slo, decode_heavy)
    for result in (heavy, light):
        best = result.recommended.layout
        assert best.num_prefill + best.num_decode == budget  # the whole budget
        assert result.recommended.goodput_rps == max(s.goodput_rps for s in result.splits)
        assert result.reason.startswith(best.label)
    assert heavy.recommended.layout.num_prefill > light.recommended.layout.num_prefill
    body = heavy.to_json()
    assert set(body) == {"recommended", "splits", "colocated", "reason"}
    assert set(body["splits"][0]) == {
        "prefill", "decode", "goodput_rps", "ttft_p90_s", "tpot_p90_s", "attainment"
    }  # fmt: skip
