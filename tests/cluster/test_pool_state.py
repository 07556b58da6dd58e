"""The pool controller's decisions without Ray: targets, bad input, plans, versions."""

from __future__ import annotations

import time

import pytest

from tandem.cluster.pool_state import Plan, PoolState, WorkerLoad, WorkerRecord
from tandem.cluster.restart_backoff import BackoffPolicy
from tandem.router.membership import PoolTargets, WorkerInfo, WorkerLifecycle
from tandem.worker.config import WorkerRole

P, D = WorkerRole.PREFILL, WorkerRole.DECODE
S = WorkerLifecycle


def state_with(workers: list[tuple[WorkerRole, WorkerLifecycle]], prefill=1, decode=1):
    state = PoolState({P: prefill, D: decode}, max_workers_per_role=4)
    for i, (role, lifecycle) in enumerate(workers):
        worker_id = state.new_worker_id(role)
        info = WorkerInfo(worker_id=worker_id, role=role, state=lifecycle)
        state.add(WorkerRecord(info=info, since_s=float(i)))
    return state


def test_plan_starts_what_is_missing():
    state = state_with([(P, S.SERVING)], prefill=1, decode=2)
    assert state.plan(0.0).start == [D, D]
    assert not state.at_target()


def test_plan_drains_least_loaded_serving_and_cancels_starting_first():
    state = state_with([(D, S.SERVING), (D, S.SERVING), (D, S.STARTING), (P, S.SERVING)])
    state.records["decode-0"].load = WorkerLoad(num_running=3, num_blocks=8, num_free_blocks=2)
    plan = state.plan(0.0)
    assert plan.cancel == ["decode-2"]
    assert plan.drain == ["decode-1"]
    assert plan.start == []


def test_draining_and_dead_do_not_count_towards_targets():
    state = state_with([(P, S.SERVING), (D, S.DRAINING), (D, S.DEAD)])
    assert state.plan(0.0).start == [D]


@pytest.mark.parametrize(
    ("targets", "field"),
    [(dict(prefill=5, decode=1), "prefill"), (dict(prefill=1, decode=9), "decode")],
)
def test_targets_over_budget_name_the_field_and_change_nothing(targets, field):
    state = state_with([(P, S.SERVING), (D, S.SERVING)])
    version = state.version
    with pytest.raises(ValueError, match=f"^{field}: .* over the budget of 4"):
        state.check_targets(PoolTargets(**targets))
    assert state.version == version
    assert state.targets == {P: 1, D: 1}


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_pool_targets_refuse_non_positive_or_non_integer(bad):
    with pytest.raises(ValueError, match="decode must be an integer >= 1"):
        PoolTargets(prefill=1, decode=bad)


def test_last_target_wins_whole():
    state = state_with([(P, S.SERVING), (D, S.SERVING)])
    state.set_targets(state.check_targets(PoolTargets(prefill=3, decode=3)))
    state.set_targets(state.check_targets(PoolTargets(prefill=1, decode=2)))
    assert state.targets == {P: 1, D: 2}
    assert state.membership().targets == PoolTargets(prefill=1, decode=2)
    assert state.plan(0.0).start == [D]


def test_drain_of_unknown_or_not_serving_worker_is_refused():
    state = state_with([(P, S.SERVING), (D, S.STARTING)])
    with pytest.raises(ValueError, match="worker_id: no worker 'decode-7'"):
        state.drain_target("decode-7")
    with pytest.raises(RuntimeError, match="worker_id: decode-0 is starting"):
        state.drain_target("decode-0")


def test_versions_grow_with_every_change_and_dead_counts_restarts():
    state = state_with([(P, S.SERVING), (D, S.SERVING)])
    v0 = state.version
    assert state.mark_dead("decode-0", now_s=10.0)
    assert state.version > v0
    assert state.restarts[D] == 1
    assert not state.mark_dead("decode-0", now_s=11.0)  # once only
    assert state.expired_dead(now_s=20.0, retention_s=30.0) == []
    assert state.expired_dead(now_s=40.0, retention_s=30.0) == ["decode-0"]
    # A draining worker that dies was leaving anyway: no restart counted.
    state.update("prefill-0", 12.0, state=S.DRAINING)
    assert not state.mark_dead("prefill-0", now_s=13.0)
    assert state.restarts[P] == 0


def test_membership_carries_load_without_a_version_change():
    state = state_with([(P, S.SERVING), (D, S.SERVING)])
    version = state.version
    state.records["decode-0"].load = WorkerLoad(num_running=2, num_waiting=1, num_blocks=10,
                                                num_free_blocks=5)  # fmt: skip
    worker = {w.worker_id: w for w in state.membership().workers}["decode-0"]
    assert (worker.running, worker.waiting, worker.kv_usage) == (2, 1, 0.5)
    assert state.version == version


def test_a_draining_node_names_its_serving_workers_and_drains_any_that_come_up_there():
    state = state_with([(P, S.SERVING), (D, S.SERVING), (D, S.STARTING), (D, S.SERVING)],
                       decode=3)  # fmt: skip
    for worker_id, node in (("prefill-0", "n1"), ("decode-0", "n2"), ("decode-2", "n2")):
        state.update(worker_id, 0.0, node=node)
    version = state.version
    # The caller drains or replaces the ones named (the controller decides which).
    assert state.drain_node("n2", 35.0) == ["decode-0", "decode-2"]
    state.update("decode-0", 5.0, state=S.DRAINING)
    state.replace("decode-2", 5.0, wait_s=30.0)
    assert state.version > version
    assert state.records["prefill-0"].state is S.SERVING
    assert state.plan(6.0).start == [D, D]
    # decode-1 was placed on n2 before its drain: it drains as soon as it is up.
    assert state.came_up("decode-1", 6.0, node="n2", endpoint="h:1", pid=7) is S.DRAINING
    info = state.records["decode-1"].info
    assert (info.state, info.endpoint, info.pid) == (S.DRAINING, "h:1", 7)
    assert state.plan(7.0).start == [D, D, D]
    # Elsewhere a worker serves; a worker being replaced is not named again.
    state.add(WorkerRecord(info=WorkerInfo(worker_id="decode-3", role=D, state=S.STARTING)))
    assert state.came_up("decode-3", 7.0, node="n3", endpoint="h:2", pid=8) is S.SERVING
    assert state.drain_node("n3", 37.0) == ["decode-3"]
    # decode-2, being replaced by 35.0, is not named again; a sooner deadline binds it.
    assert state.drain_node("n2", 20.0) == []
    assert state.records["decode-2"].replace_by_s == 20.0


def test_a_worker_being_replaced_serves_until_its_replacement_does():
    state = state_with([(P, S.SERVING), (D, S.SERVING)])
    state.replace("decode-0", 10.0, wait_s=60.0)
    decode = {w.worker_id: w for w in state.membership().workers}["decode-0"]
    assert (decode.state, decode.being_replaced) == (S.SERVING, True)
    plan = state.plan(11.0)
    assert (plan.start, plan.replaced, plan.drain) == ([D], [], [])
    assert not state.at_target()
    state.add(WorkerRecord(info=WorkerInfo(worker_id="decode-1", role=D, state=S.STARTING)))
    assert state.plan(12.0) == Plan()  # the replacement loads; decode-0 serves on
    with pytest.raises(RuntimeError, match="worker_id: decode-0 is being replaced already"):
        state.drain_target("decode-0")
    assert state.came_up("decode-1", 20.0, node="n1", endpoint="h:1", pid=7) is S.SERVING
    assert state.plan(20.0).replaced == ["decode-0"]
    state.update("decode-0", 20.0, state=S.DRAINING)
    decode = {w.worker_id: w for w in state.membership().workers}["decode-0"]
    assert (decode.state, decode.being_replaced) == (S.DRAINING, False)
    assert state.records["decode-0"].replace_by_s is None
    assert state.plan(21.0) == Plan()


def test_a_worker_being_replaced_drains_when_its_wait_runs_out():
    state = state_with([(P, S.SERVING), (D, S.SERVING), (D, S.STARTING)])
    state.replace("decode-0", 10.0, wait_s=30.0)
    assert state.plan(39.9).replaced == []
    assert state.plan(40.0).replaced == ["decode-0"]


def test_of_workers_being_replaced_the_busiest_serve_until_the_last_replacement_does():
    state = state_with([(P, S.SERVING), (D, S.SERVING), (D, S.SERVING), (D, S.SERVING)],
                       decode=3)  # fmt: skip
    state.records["decode-0"].load = WorkerLoad(num_running=5)
    state.records["decode-1"].load = WorkerLoad(num_running=1)
    state.replace("decode-0", 0.0, wait_s=60.0)
    state.replace("decode-1", 0.0, wait_s=60.0)
    assert state.plan(1.0).start == [D, D]
    state.add(WorkerRecord(info=WorkerInfo(worker_id="decode-3", role=D, state=S.SERVING)))
    assert state.plan(2.0).replaced == ["decode-1"]  # the least loaded goes first
    # The target drops to 1: both being replaced drain, and one of the two others, as in
    # any scale-down.
    state.set_targets({P: 1, D: 1})
    plan = state.plan(3.0)
    assert sorted(plan.replaced) == ["decode-0", "decode-1"]
    assert len(plan.drain) == 1 and plan.drain[0] in ("decode-2", "decode-3")


def test_a_worker_being_replaced_that_dies_is_not_a_restart():
    state = state_with([(P, S.SERVING), (D, S.SERVING)])
    state.replace("decode-0", 0.0, wait_s=60.0)
    assert not state.mark_dead("decode-0", now_s=1.0)
    assert state.restarts[D] == 0
    assert state.plan(2.0).start == [D]  # still one replacement, not two


def start_and_fail(state: PoolState, role: WorkerRole, now_s: float, served_s: float | None):
    """A new worker of `role` that dies at now_s, having served `served_s` (None: while
    starting)."""
    worker_id = state.new_worker_id(role)
    info = WorkerInfo(worker_id=worker_id, role=role, state=S.STARTING)
    state.add(WorkerRecord(info=info, since_s=now_s - 1.0))
    if served_s is not None:
        state.update(worker_id, now_s - served_s, state=S.SERVING)
    assert state.mark_dead(worker_id, now_s)


def test_a_role_whose_workers_keep_dying_young_starts_the_next_after_a_growing_pause():
    """A crash loop (a worker that cannot live) is held back, as CrashLoopBackOff does:
    the first death restarts at once, then 2, 4, 8 s ... up to the cap; the other role
    is not held back."""
    state = PoolState({P: 1, D: 1}, 4, BackoffPolicy(base_s=2.0, max_s=5.0, stable_s=60.0))
    start_and_fail(state, D, 100.0, served_s=None)
    assert state.plan(100.0).start == [P, D]  # one death: at once
    held = []
    for now_s in (101.0, 110.0, 130.0, 160.0):
        start_and_fail(state, D, now_s, served_s=5.0)  # served, but not for 60 s
        held.append(state.backoff.held_s(D, now_s))
        assert state.plan(now_s).start == [P]
        assert state.plan(now_s + held[-1]).start == [P, D]
    assert held == [2.0, 4.0, 5.0, 5.0]
    assert state.backoff.failures == {D: 5}


def test_the_membership_shows_a_held_role_until_its_hold_has_passed():
    """What `/admin/pools`, `tandem pools` and the hold gauge read: the role held, its
    failures in a row, and the end of the hold on the wall clock; nothing once it has
    passed, and nothing for a role not held."""
    state = PoolState({P: 1, D: 1}, 4, BackoffPolicy(base_s=0.3, max_s=5.0, stable_s=60.0))
    start_and_fail(state, D, 100.0, served_s=None)
    assert state.membership().restart_holds == {}  # one death: no hold
    start_and_fail(state, D, 101.0, served_s=None)
    hold = state.membership().restart_holds["decode"]
    assert hold.failures == 2
    assert 0.0 < hold.seconds_left(time.time()) <= 0.3
    assert set(state.membership().restart_holds) == {"decode"}
    time.sleep(0.35)
    assert state.membership().restart_holds == {}


def test_a_worker_that_served_long_before_it_died_is_replaced_at_once_and_ends_the_series():
    state = PoolState({P: 1, D: 1}, 4, BackoffPolicy(base_s=2.0, max_s=60.0, stable_s=60.0))
    for now_s in (10.0, 11.0, 12.0):
        start_and_fail(state, D, now_s, served_s=None)
    assert state.backoff.held_s(D, 12.0) == 4.0
    start_and_fail(state, D, 200.0, served_s=120.0)
    assert state.backoff.held_s(D, 200.0) == 0.0
    assert D in state.plan(200.0).start
    start_and_fail(state, D, 201.0, served_s=None)  # the series begins again at 2 s
    assert state.backoff.held_s(D, 201.0) == 2.0


def test_a_worker_that_drains_or_is_being_replaced_adds_nothing_to_the_backoff():
    state = state_with([(D, S.DRAINING), (D, S.SERVING), (P, S.SERVING)], decode=1)
    state.replace("decode-1", 5.0, 60.0)
    for worker_id in ("decode-0", "decode-1", "decode-0"):
        state.mark_dead(worker_id, 6.0)
    assert state.backoff.failures == {}
    assert state.backoff.held_s(D, 6.0) == 0.0


def test_workers_that_die_together_are_one_failure_not_a_loop():
    """A node lost with three young decode workers on it: their replacements start at
    once (none of them was a restart that failed); a replacement that dies young then
    extends the series."""
    state = PoolState({P: 1, D: 3}, 4, BackoffPolicy(base_s=2.0, max_s=60.0, stable_s=60.0))
    ids = []
    for _ in range(3):
        ids.append(state.new_worker_id(D))
        info = WorkerInfo(worker_id=ids[-1], role=D, state=S.STARTING)
        state.add(WorkerRecord(info=info, since_s=1.0))
        state.update(ids[-1], 5.0, state=S.SERVING)
    for worker_id in ids:
        state.mark_dead(worker_id, 30.0)
    assert state.backoff.held_s(D, 30.0) == 0.0
    assert state.plan(30.0).start.count(D) == 3
    start_and_fail(state, D, 40.0, served_s=None)  # a replacement, started at 39
    assert state.backoff.held_s(D, 40.0) == 2.0


def test_the_series_ends_when_failures_stop_for_a_while_and_the_hold_never_overflows():
    policy = BackoffPolicy(base_s=2.0, max_s=60.0, stable_s=60.0)
    state = PoolState({P: 1, D: 1}, 4, policy)
    for now_s in (10.0, 11.0, 12.0):
        start_and_fail(state, D, now_s, served_s=None)
    assert state.backoff.failures[D] == 3
    start_and_fail(state, D, 12.0 + 121.0, served_s=None)  # over stable_s + max_s later
    assert state.backoff.failures[D] == 1 and state.backoff.held_s(D, 133.0) == 0.0
    assert policy.delay_s(5000) == 60.0  # (2.0 ** 4998 overflows a float)
    assert BackoffPolicy(base_s=0.0).delay_s(7) == 0.0  # 0: no backoff
