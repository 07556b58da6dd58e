"""A role held back by the restart backoff, as SREs and clients see it: `GET
/admin/pools` and gRPC `GetPools`, `tandem pools`' table,
`tandem:worker_restart_hold_seconds`, and the router's 503s' Retry-After (the pool
controller puts the hold in the membership: tests/cluster/test_pool_state.py, and end to
end test_self_healing.py; the Retry-After itself: tests/router/policy/test_pair_selector.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from tandem.cluster.admin_client import format_table, membership_json
from tandem.router.admin import PoolsAdmin
from tandem.router.admin_service import AdminService
from tandem.router.config import RouterConfig
from tandem.router.membership import (
    Membership,
    PoolTargets,
    RestartHold,
    WorkerInfo,
    WorkerLifecycle,
)
from tandem.router.policy import GoodputPolicy, WorkerState
from tandem.router.policy_runtime import PolicyRuntime
from tandem.router.pool_gauges import PoolGauges
from tandem.router.worker_pool import WorkerEndpoint, WorkerPool
from tandem.worker.config import WorkerRole


def held_membership(seconds_left: float) -> Membership:
    workers = [
        WorkerInfo("prefill-0", WorkerRole.PREFILL, WorkerLifecycle.SERVING, "127.0.0.1:1"),
        WorkerInfo("decode-2", WorkerRole.DECODE, WorkerLifecycle.DEAD),
    ]
    hold = RestartHold(failures=3, until_unix_s=time.time() + seconds_left)
    return Membership(
        7, workers, PoolTargets(1, 1), {"prefill": 0, "decode": 3}, "owner-1", {"decode": hold}
    )


def test_the_admin_api_shows_the_hold_over_http_and_grpc():
    membership = held_membership(12.0)
    admin = PoolsAdmin(backend=None, load=lambda worker_id: None)
    view = admin.to_json(membership)
    assert set(view["restart_holds"]) == {"decode"}
    hold = view["restart_holds"]["decode"]
    assert hold["failures"] == 3
    assert hold["until_unix_s"] == membership.restart_holds["decode"].until_unix_s
    assert 11.0 <= hold["seconds_left"] <= 12.0

    reply = AdminService(admin)._response(membership)
    assert set(reply.restart_holds) == {"decode"}
    assert reply.restart_holds["decode"].failures == 3
    assert reply.restart_holds["decode"].until_unix_s == pytest.approx(hold["until_unix_s"])
    # A hold that has passed since the snapshot: in neither view.
    assert admin.to_json(held_membership(-1.0))["restart_holds"] == {}
    assert not AdminService(admin)._response(held_membership(-1.0)).restart_holds


def test_tandem_pools_prints_the_hold_under_the_table():
    view = membership_json(held_membership(12.0))
    assert view["restart_holds"]["decode"]["failures"] == 3
    lines = format_table(view).splitlines()
    assert lines[-2] == "targets: prefill 1, decode 1"
    assert lines[-1] in {
        f"decode: next start held {s} s more (restart backoff: 3 died young in a row)"
        for s in (11, 12)
    }
    assert (
        format_table(membership_json(held_membership(-1.0))).splitlines()[-1].startswith("targets:")
    ), "a hold that has passed is not printed"


def test_the_hold_gauge_counts_down_and_is_zero_for_a_role_not_held():
    registry = CollectorRegistry()
    PoolGauges(registry).update(held_membership(12.0))

    def hold_s(role: str) -> float | None:
        return registry.get_sample_value("tandem:worker_restart_hold_seconds", {"role": role})

    assert 11.0 <= (hold_s("decode") or 0.0) <= 12.0
    assert hold_s("prefill") == 0.0
    PoolGauges(registry2 := CollectorRegistry()).update(held_membership(-1.0))
    assert (
        registry2.get_sample_value("tandem:worker_restart_hold_seconds", {"role": "decode"}) == 0.0
    )


def test_the_router_follows_the_decode_roles_hold_for_its_503s(tiny_model_dir):
    """What `Router.update_membership` hands the policy: the latest end of a hold of a
    decode-capable role (decode or colocated); a prefill hold changes nothing."""

    async def scenario() -> None:
        pool = WorkerPool([WorkerEndpoint("decode-0", "decode", "127.0.0.1:1")])
        try:
            runtime = PolicyRuntime(RouterConfig(model_dir=str(tiny_model_dir)), pool)
            decode = [WorkerState("decode-0", "decode", block_size=16, num_blocks=64)]
            runtime.policy = GoodputPolicy([], decode)
            selector = runtime.policy.selector
            now = time.time()
            runtime.follow_restart_holds(
                {"prefill": RestartHold(4, now + 50.0), "decode": RestartHold(2, now + 10.0)}
            )
            assert selector.decode_start_held_until_unix_s == now + 10.0
            runtime.follow_restart_holds({"colocated": RestartHold(3, now + 20.0)})
            assert selector.decode_start_held_until_unix_s == now + 20.0
            runtime.follow_restart_holds({"prefill": RestartHold(4, now + 50.0)})
            assert selector.decode_start_held_until_unix_s == 0.0
        finally:
            await pool.close()

    asyncio.run(scenario())
