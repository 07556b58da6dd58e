"""The pool controller on a real local Ray: healing after kill -9, scale, drain, bad input.

Workers are real Ray actor processes serving the tiny model; the controller is the
named actor a `LocalCluster` starts; changes are followed through a real
`MembershipWatcher` and admin calls go through the real `RayAdminBackend`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest
import ray

from tandem.cluster.admin_backend import RayAdminBackend
from tandem.cluster.controller_link import ControllerLink
from tandem.cluster.launcher import LocalCluster
from tandem.cluster.membership_watcher import MembershipWatcher
from tandem.router.membership import (
    Membership,
    PoolTargets,
    TargetsChanged,
    UnknownWorker,
    WorkerLifecycle,
)
from tests.helpers.grpc_calls import generate_tokens
from tests.helpers.parallel import DISRUPTS_ITS_CLUSTER
from tests.helpers.prompts import make_prompts
from tests.helpers.ray_pools import (
    assert_idle,
    cluster_config,
    init_ray_with_role_slots,
    pid_gone,
    scrape,
    serving,
    until,
    wait_membership,
)

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow, DISRUPTS_ITS_CLUSTER]


@pytest.fixture(scope="module")
def ray_session():
    init_ray_with_role_slots()
    yield
    ray.shutdown()


def test_kill_9_decode_worker_is_replaced_and_watchers_see_it(ray_session, tiny_model_dir):
    async def scenario() -> None:
        config = cluster_config(tiny_model_dir)
        # Every watcher must see the dead entry before it expires (a loaded machine may
        # answer a long poll late: 2 s was tight).
        config.pools = dataclasses.replace(config.pools, dead_retention_s=10.0)
        cluster = LocalCluster(config)
        seen: list[Membership] = []
        try:
            await cluster.start()
            watcher = MembershipWatcher(
                ControllerLink(cluster.controller), seen.append, poll_timeout_s=2.0
            )
            watcher.start()
            before = await cluster.membership()
            [decode] = serving(before, "decode")
            assert decode.pid and decode.node and decode.metrics_url.endswith("/metrics")
            prompts = make_prompts(2048, (5, 40), seed=3)
            assert len(await generate_tokens(cluster.router.grpc_endpoint, prompts, 4)) == 2
            # The decode worker has told the prefill worker it is done with the prompts'
            # KV (a best-effort Release after the last token may still be on its way;
            # killed before it lands, the prefill side's lease frees the blocks, in 30 s).
            await assert_idle(before, auth=cluster.config.worker.cluster_auth)

            killed_at = time.monotonic()
            os.kill(decode.pid, signal.SIGKILL)
            healed = await wait_membership(
                cluster,
                lambda m: any(w.worker_id != decode.worker_id for w in serving(m, "decode")),
                timeout_s=60.0,
                what="a replacement decode worker serving",
            )
            heal_s = time.monotonic() - killed_at
            assert heal_s < 60.0
            [replacement] = serving(healed, "decode")
            assert replacement.pid != decode.pid
            assert await cluster.controller.restarts.remote() == {"prefill": 0, "decode": 1}
            # Every router watching saw the dead worker, then the replacement.
            states = [{w.worker_id: w.state for w in m.workers}.get(decode.worker_id) for m in seen]
            assert WorkerLifecycle.DEAD in states
            assert [m.version for m in seen] == sorted({m.version for m in seen})

            # The dead entry is dropped after its retention; metrics agree with the pools.
            final = await wait_membership(
                cluster,
                lambda m: all(w.state is WorkerLifecycle.SERVING for w in m.workers),
                timeout_s=30.0,
                what="the dead entry to expire",
            )
            metrics = scrape(cluster.controller_metrics_url)
            for role in ("prefill", "decode"):
                assert metrics[f'tandem:pool_workers{{role="{role}",state="serving"}}'] == len(
                    serving(final, role)
                )
                assert metrics[f'tandem:pool_workers{{role="{role}",state="dead"}}'] == 0
                assert metrics[f'tandem:pool_target_workers{{role="{role}"}}'] == 1
            assert metrics['tandem:worker_restarts_total{role="decode"}'] == 1
            assert metrics['tandem:worker_restarts_total{role="prefill"}'] == 0
            await watcher.stop()
            await assert_idle(final, auth=cluster.config.worker.cluster_auth)
        finally:
            await cluster.stop()
        pids = [w.pid for w in final.workers]
        await until(lambda: all(pid_gone(p) for p in pids), 30.0, "worker processes gone")

    asyncio.run(scenario())


def test_scale_drain_and_bad_input(ray_session, tiny_model_dir):
    async def scenario() -> None:
        cluster = LocalCluster(cluster_config(tiny_model_dir))
        try:
            await cluster.start()
            admin = RayAdminBackend(ControllerLink(cluster.controller))
            start = await admin.get_pools()
            assert start.targets == PoolTargets(prefill=1, decode=1)

            # Bad input: the field is named and nothing changes.
            with pytest.raises(ValueError, match="decode: 5 workers is over the budget of 4"):
                await admin.scale(PoolTargets(prefill=1, decode=5))
            with pytest.raises(RuntimeError, match="decode: 4 workers, but the Ray cluster"):
                await admin.scale(PoolTargets(prefill=1, decode=4))
            with pytest.raises(UnknownWorker, match="worker_id: no worker 'decode-9'"):
                await admin.drain("decode-9")
            # A compare-and-set scale (the planner's) whose targets changed meanwhile.
            with pytest.raises(TargetsChanged, match="they changed meanwhile"):
                await admin.scale(PoolTargets(prefill=1, decode=2), if_targets=PoolTargets(2, 1))
            unchanged = await admin.get_pools()
            assert unchanged.version == start.version
            assert unchanged.targets == start.targets

            # Concurrent scale calls: each applies whole, and the one applied last (the
            # higher version) is the state. Ray runs an async actor's calls in no guaranteed
            # order (a loaded CI machine ran the second one first), so what follows first
            # settles on one target.
            wide, narrow = PoolTargets(prefill=2, decode=3), PoolTargets(prefill=1, decode=2)
            results = await asyncio.gather(admin.scale(wide), admin.scale(narrow))
            assert {r.targets for r in results} == {wide, narrow}
            applied_last = max(results, key=lambda r: r.version)
            assert (await admin.get_pools()).targets == applied_last.targets
            await admin.scale(narrow)
            up = await cluster.controller.wait_at_target.remote(120.0)
            assert up.targets == PoolTargets(prefill=1, decode=2)
            assert len(serving(up, "decode")) == 2 and len(serving(up, "prefill")) == 1
            assert len({w.pid for w in up.workers}) == 3

            # Drain one worker by name: it serves on while a replacement starts (Ray has
            # room for one more, once its view counts the slot of the decode worker the
            # scale-down stopped: it lags the stop, and the controller asks Ray), then
            # drains and stops idle.
            await until(
                lambda: ray.available_resources().get("tandem_decode", 0) >= 1,
                30.0, "Ray's view to free the stopped decode worker's slot",
            )  # fmt: skip
            [first, second] = serving(up, "decode")
            drained = await admin.drain(first.worker_id)
            [named] = [w for w in drained.workers if w.worker_id == first.worker_id]
            assert (named.state, named.being_replaced) == (WorkerLifecycle.SERVING, True)
            with pytest.raises(RuntimeError, match="is being replaced already"):
                await admin.drain(first.worker_id)
            after = await cluster.controller.wait_at_target.remote(120.0)
            ids = {w.worker_id for w in serving(after, "decode")}
            assert first.worker_id not in ids and second.worker_id in ids and len(ids) == 2

            # Scale down: the surplus decode worker drains, then stops with every block free.
            await admin.scale(PoolTargets(prefill=1, decode=1))
            down = await cluster.controller.wait_at_target.remote(120.0)
            assert len(serving(down, "decode")) == 1
            loads = await cluster.controller.drained_loads.remote()
            assert first.worker_id in loads and len(loads) == 2
            for worker_id, load in loads.items():
                assert load.is_idle and load.num_free_blocks == load.num_blocks, worker_id
            await assert_idle(down, auth=cluster.config.worker.cluster_auth)
        finally:
            await cluster.stop()

    asyncio.run(scenario())


def test_hung_worker_fails_health_checks_and_is_replaced(ray_session, tiny_model_dir):
    """A worker that stops answering (SIGSTOP: the process is alive but frozen) is
    declared dead after `max_health_failures` probes time out, killed and replaced."""
    config = cluster_config(tiny_model_dir)
    config.pools = dataclasses.replace(config.pools, health_timeout_s=1.0, max_health_failures=2)

    async def scenario() -> None:
        cluster = LocalCluster(config)
        try:
            await cluster.start()
            [prefill] = serving(await cluster.membership(), "prefill")
            os.kill(prefill.pid, signal.SIGSTOP)
            healed = await wait_membership(
                cluster,
                lambda m: any(w.worker_id != prefill.worker_id for w in serving(m, "prefill")),
                timeout_s=60.0,
                what="a replacement prefill worker serving",
            )
            states = {w.worker_id: w.state for w in healed.workers}
            assert states.get(prefill.worker_id) in (WorkerLifecycle.DEAD, None)
            assert await cluster.controller.restarts.remote() == {"prefill": 1, "decode": 0}
            await until(lambda: pid_gone(prefill.pid), 30.0, "the frozen worker killed")
            await assert_idle(
                await cluster.controller.wait_at_target.remote(30.0),
                auth=cluster.config.worker.cluster_auth,
            )
        finally:
            await cluster.stop()

    asyncio.run(scenario())
