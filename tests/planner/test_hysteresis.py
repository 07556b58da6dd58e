"""The auto planner's resize gate: one worker at a time, after agreeing plans, not too often
(whether a split pays is the plan's call: `min_gain` in test_live_inputs.py)."""

from __future__ import annotations

import pytest

from tandem.planner.hysteresis import ResizeGate, one_step
from tandem.planner.live_config import PlannerConfig


def gate() -> ResizeGate:
    return ResizeGate(min_change_interval_s=10.0, confirmations=2)


def test_moves_one_worker_after_two_agreeing_plans():
    g = gate()
    assert g.decide(0.0, (1, 2), (2, 1), at_target=True)[0] is None
    target, why = g.decide(1.0, (1, 2), (2, 1), at_target=True)
    assert target == (2, 1)
    assert "one worker" in why


def test_waits_between_changes_and_while_a_change_is_in_progress():
    g = gate()
    g.decide(0.0, (1, 3), (3, 1), True)
    assert g.decide(1.0, (1, 3), (3, 1), True)[0] == (2, 2)
    g.changed(1.0, (2, 2))
    assert g.decide(2.0, (2, 2), (3, 1), False)[1].startswith("waiting for the last change")
    assert g.decide(5.0, (2, 2), (3, 1), True)[1] == "too soon after the last change"
    assert g.decide(11.0, (2, 2), (3, 1), True)[0] == (3, 1)


def test_a_refused_resize_does_not_hold_back_the_next():
    """The change time was taken when `decide` proposed a resize, so a resize the pools'
    owner refused still blocked the next for min_change_interval_s."""
    g = gate()
    g.decide(0.0, (1, 3), (3, 1), True)
    assert g.decide(1.0, (1, 3), (3, 1), True)[0] == (2, 2)  # refused: no `changed`
    assert g.decide(2.0, (1, 3), (3, 1), True)[0] == (2, 2)


def test_an_operators_scale_counts_as_a_change_and_resets_the_confirmations():
    """The first plan made after a `tandem scale` acted on it, confirmed by a plan made
    from the split before (probe: scaled to 2P+1D by hand, undone 3.5 s later)."""
    g = gate()
    assert g.decide(0.0, (2, 1), (1, 2), True)[0] is None  # waiting for a second plan
    # The operator scales to 2P+2D; the next plan, from that split:
    assert g.decide(1.0, (2, 2), (1, 2), True) == (None, "too soon after the last change")
    # Past the interval, with two plans made from (2, 2): it may act.
    assert g.decide(12.0, (2, 2), (1, 2), True)[0] == (1, 2)
    # Before, the plan from (2, 1) counted: a second plan acted at once, undoing the scale.
    h = gate()
    h.decide(0.0, (2, 1), (1, 2), True)
    h.decide(11.0, (2, 2), (1, 1), True)  # the operator's scale, then another plan
    assert h.decide(22.0, (2, 2), (1, 2), True)[0] is None  # (1, 1) and (1, 2) disagree


def test_no_change_for_a_flapping_recommendation():
    g = gate()
    g.decide(0.0, (2, 2), (3, 1), True)
    assert g.decide(1.0, (2, 2), (1, 3), True)[0] is None
    assert g.decide(2.0, (2, 2), (2, 2), True) == (None, "already at the recommended split")


@pytest.mark.parametrize(
    ("current", "wanted", "step"),
    [((1, 3), (3, 1), (2, 2)), ((3, 1), (1, 3), (2, 2)), ((1, 1), (2, 1), (2, 1)),
     ((2, 2), (1, 2), (1, 2)), ((2, 2), (2, 1), (2, 1))],
)  # fmt: skip
def test_one_step(current, wanted, step):
    assert one_step(current, wanted) == step


def test_config_refuses_a_budget_below_two():
    with pytest.raises(ValueError, match="max_workers"):
        PlannerConfig(max_workers=1)
    assert PlannerConfig(interval_s=5).change_interval_s == 15
