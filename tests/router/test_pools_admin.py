"""Admin API (gRPC `tandem.admin.v1.Admin`, HTTP `/admin/*`) and live membership
changes, against an in-process pools owner with real workers (`InprocPools`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
import grpc
import pytest

from tandem.cluster.admin_client import format_table
from tandem.decode_worker.server import DecodeWorker
from tandem.engine.config import EngineConfig
from tandem.proto.tandem.admin.v1 import admin_pb2 as admin_pb
from tandem.proto.tandem.admin.v1 import admin_pb2_grpc
from tandem.router.membership import (
    Membership,
    PoolsOwnerUnreachable,
    PoolTargets,
    RestartHold,
    WorkerInfo,
    WorkerLifecycle,
)
from tandem.worker.config import WorkerConfig, WorkerRole
from tests.helpers.grpc_calls import (
    TEST_API_KEY,
    assert_workers_idle,
    generate_tokens,
    stream_tokens,
)
from tests.helpers.inproc_cluster import SHARED_API_KEY
from tests.helpers.inproc_pools import InprocPools
from tests.helpers.kv_budget import TEST_KV_CACHE_BYTES
from tests.helpers.prompts import make_prompts
from tests.helpers.ray_pools import admin_pool_counts, metrics_pool_counts, scrape
from tests.helpers.router_metrics import migration_counts

pytestmark = pytest.mark.timeout(600)

API_KEY = TEST_API_KEY  # the key test clients send (grpc_calls' helpers too)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {API_KEY}"),)


@pytest.fixture(scope="module")
def pools(tiny_model_dir):
    pools = InprocPools(str(tiny_model_dir), PoolTargets(1, 1), api_key=API_KEY).start()
    yield pools
    pools.stop()


async def http(pools: InprocPools, method: str, path: str, body=None, headers=AUTH):
    async with (
        aiohttp.ClientSession() as session,
        session.request(
            method,
            f"{pools.router.http_endpoint}{path}",
            json=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=30),
        ) as response,
    ):
        return response.status, await response.json()


def assert_pools_idle(pools: InprocPools) -> None:
    workers = [(i.endpoint, i.role.value) for i in pools.infos.values()]
    pools.run(assert_workers_idle(workers, max_channels=4, timeout_s=10))
    policy = pools.router.policy_runtime.policy
    assert policy.is_idle(), f"router policy still charges {policy.num_in_flight} requests"


def test_get_pools_lists_workers_and_targets(pools):
    status, body = pools.run(http(pools, "GET", "/admin/pools"))
    assert status == 200
    assert body["targets"] == {"prefill": 1, "decode": 1}
    assert sorted(w["role"] for w in body["workers"]) == ["decode", "prefill"]
    for worker in body["workers"]:
        assert set(worker) >= {"id", "role", "state", "node", "pid", "threads", "endpoint",
                               "metrics_url", "running", "waiting", "kv_usage",
                               "predicted_step_s", "predicted_queue_s"}  # fmt: skip
        assert worker["state"] == "serving" and worker["endpoint"]
        assert 0.0 <= worker["kv_usage"] <= 1.0
        # The router's latency models: a decode worker's next step (idle: its fixed cost
        # plus one sequence), none for a prefill worker; an empty queue waits nothing.
        policy_state = pools.router.policy_runtime.policy.workers[worker["id"]]
        if worker["role"] == "decode":
            assert worker["predicted_step_s"] == round(policy_state.predicted_step_s(1), 6) > 0
        else:
            assert worker["predicted_step_s"] == 0.0
        assert worker["predicted_queue_s"] == 0.0

    async def grpc_pools() -> admin_pb.PoolsResponse:
        async with grpc.aio.insecure_channel(pools.router.grpc_endpoint) as channel:
            stub = admin_pb2_grpc.AdminStub(channel)
            return await stub.GetPools(admin_pb.GetPoolsRequest(), metadata=GRPC_AUTH, timeout=10)

    reply = pools.run(grpc_pools())
    assert {w.id for w in reply.workers} == {w["id"] for w in body["workers"]}
    by_id = {w["id"]: w for w in body["workers"]}
    for w in reply.workers:
        assert w.predicted_step_s == by_id[w.id]["predicted_step_s"]
    assert (reply.version, reply.owner) == (body["version"], body["owner"])
    assert (reply.targets.prefill, reply.targets.decode) == (1, 1)


def test_a_restart_hold_in_the_membership_reaches_the_admin_api_and_the_policy(pools):
    """The router follows the owner's restart holds: `/admin/pools` shows one, and its
    503s for want of a decode worker would ask clients to wait it out (Retry-After)."""
    selector = pools.router.policy_runtime.policy.selector
    until = time.time() + 30.0
    pools.run(pools.set_restart_holds({"decode": RestartHold(3, until)}))
    try:
        assert selector.decode_start_held_until_unix_s == until
        status, body = pools.run(http(pools, "GET", "/admin/pools"))
        assert status == 200
        assert body["restart_holds"]["decode"]["failures"] == 3
        assert 25.0 < body["restart_holds"]["decode"]["seconds_left"] <= 30.0
    finally:
        pools.run(pools.set_restart_holds({}))
    assert selector.decode_start_held_until_unix_s == 0.0
    assert pools.run(http(pools, "GET", "/admin/pools"))[1]["restart_holds"] == {}


def test_a_join_retry_that_fails_unexpectedly_is_tried_again(pools, monkeypatch):
    """The router's join retries go on past an error they do not expect (before, the
    retry task ended with it, and no later join was retried until the next membership)."""
    router = pools.router
    real_join, calls = router._join, []

    async def flaky_join(info: WorkerInfo) -> None:
        calls.append(info.worker_id)
        if len(calls) == 1:
            raise RuntimeError("injected join failure")
        await real_join(info)

    monkeypatch.setattr(router, "_join", flaky_join)
    info = next(i for i in pools.infos.values() if i.role is WorkerRole.DECODE)

    async def scenario() -> None:
        router._pending[info.worker_id] = info
        async with asyncio.timeout(10):
            while len(calls) < 2 or router._pending:
                await asyncio.sleep(0.1)

    pools.run(scenario())
    assert calls == [info.worker_id, info.worker_id]
    assert not router._join_retry.done()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prefill": 0, "decode": 1}, "prefill"),
        ({"prefill": 1, "decode": -2}, "decode"),
        ({"prefill": 1}, "decode"),
        ({"prefill": 1, "decode": 1, "gpu": 1}, "gpu"),
        ({"prefill": "2", "decode": 1}, "prefill"),
        ({"prefill": True, "decode": 1}, "prefill"),
        ({"prefill": 9, "decode": 1}, "prefill"),  # beyond the owner's budget
        ([1, 1], None),
    ],
)
def test_bad_scale_is_refused_and_changes_nothing(pools, body, param):
    before = pools.version, pools.targets
    status, reply = pools.run(http(pools, "POST", "/admin/scale", body))
    assert status == 400, reply
    assert reply["error"]["param"] == param
    if param is not None:
        assert param in reply["error"]["message"]
    assert (pools.version, pools.targets) == before


def test_a_refused_scale_is_logged_as_refused(pools, caplog):
    """A scale the owner refused was logged as "admin: scale to 9 prefill + 1 decode",
    as if it had happened."""
    with caplog.at_level(logging.INFO, logger="tandem.router.admin"):
        status, _ = pools.run(http(pools, "POST", "/admin/scale", {"prefill": 9, "decode": 1}))
    assert status == 400
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("admin:")]
    assert len(lines) == 1 and lines[0].startswith(
        "admin: scale to 9 prefill + 1 decode refused: "
    ), lines


def test_a_worker_id_cannot_forge_a_log_line(pools, caplog):
    """The id a client names was logged raw before it was checked: a newline in it wrote
    a line of the client's own into the router log."""
    with caplog.at_level(logging.INFO):
        for worker_id in ("nobody\n2026-12-06 INFO forged", "x" * 300):
            status, _ = pools.run(http(pools, "POST", "/admin/drain", {"worker_id": worker_id}))
            assert status in (400, 404, 409)
    lines = [r.getMessage() for r in caplog.records if "admin: drain" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith("admin: drain of 'nobody\\n2026-12-06 INFO forged' refused")


def test_admin_errors_over_grpc_and_auth(pools):
    version = pools.version

    async def scenario() -> dict[str, grpc.StatusCode]:
        codes = {}
        async with grpc.aio.insecure_channel(pools.router.grpc_endpoint) as channel:
            stub = admin_pb2_grpc.AdminStub(channel)
            auth = {"metadata": GRPC_AUTH, "timeout": 10}
            calls = {
                "zero": stub.ScalePools(admin_pb.ScalePoolsRequest(prefill=0, decode=1), **auth),
                "missing": stub.ScalePools(admin_pb.ScalePoolsRequest(prefill=1), **auth),
                "unknown_worker": stub.DrainWorker(
                    admin_pb.DrainWorkerRequest(worker_id="nope"), **auth
                ),
                "no_key": stub.GetPools(admin_pb.GetPoolsRequest(), timeout=10),
            }
            for name, call in calls.items():
                try:
                    await call
                    codes[name] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    codes[name] = exc.code()
                    if name == "missing":
                        assert "decode" in exc.details()
                    if name == "unknown_worker":
                        assert "worker_id" in exc.details()
        return codes

    assert pools.run(scenario()) == {
        "zero": grpc.StatusCode.INVALID_ARGUMENT,
        "missing": grpc.StatusCode.INVALID_ARGUMENT,
        "unknown_worker": grpc.StatusCode.NOT_FOUND,
        "no_key": grpc.StatusCode.UNAUTHENTICATED,
    }
    status, _ = pools.run(http(pools, "GET", "/admin/pools", headers={}))
    assert status == 401
    status, reply = pools.run(http(pools, "POST", "/admin/drain", {"worker_id": "nope"}))
    assert status == 404 and reply["error"]["param"] == "worker_id"
    # A huge id is refused without being echoed back.
    status, reply = pools.run(http(pools, "POST", "/admin/drain", {"worker_id": "x" * 10_000}))
    assert status == 400 and reply["error"]["param"] == "worker_id"
    assert len(reply["error"]["message"]) < 200
    # A lone UTF-16 surrogate is not text: 400 naming the field, in JSON.
    status, reply = pools.run(http(pools, "POST", "/admin/drain", {"worker_id": "d\ud800"}))
    assert status == 400 and reply["error"]["param"] == "worker_id", reply
    # A misspelt field is refused, as /admin/scale refuses one (it drained prefill-0).
    body = {"worker_id": "prefill-0", "timeout": 5}
    status, reply = pools.run(http(pools, "POST", "/admin/drain", body))
    assert status == 400 and reply["error"]["param"] == "timeout", reply
    assert pools.version == version, "nothing was drained"


def test_scale_up_then_down_under_load_fails_nothing(pools):
    """Scale to 1P+2D: the new decode worker takes requests. Then back to 1P+1D while
    streams run: the drained worker's streams finish, no request fails, it stops idle."""
    prompts = make_prompts(2048, (20, 60, 33, 80), seed=81)
    reference = pools.run(generate_tokens(pools.router.grpc_endpoint, prompts, 48))

    status, _ = pools.run(http(pools, "POST", "/admin/scale", {"prefill": 1, "decode": 2}))
    assert status == 200
    pools.run(pools.wait_settled())
    decode_ids = pools.serving(WorkerRole.DECODE)
    assert len(decode_ids) == 2
    router_view = {w.worker_id for w in pools.router.pool.workers}
    assert set(decode_ids) <= router_view
    # The router's pool gauges say what /admin/pools says.
    _, view = pools.run(http(pools, "GET", "/admin/pools"))
    gauges = metrics_pool_counts(scrape(f"{pools.router.http_endpoint}/metrics"))
    assert gauges == admin_pool_counts(view) == ({("prefill", "serving"): 1,
                                                  ("decode", "serving"): 2},
                                                 {"prefill": 1, "decode": 2})  # fmt: skip

    async def land_on_each() -> set[str]:
        # Long streams so both decode workers hold some at once.
        policy = pools.router.policy_runtime.policy
        tasks = [
            asyncio.ensure_future(
                stream_tokens(pools.router.grpc_endpoint, f"up-{i}", p, max_tokens=120)
            )
            for i, p in enumerate(make_prompts(2048, (30, 31, 32, 33, 34, 35), seed=82))
        ]
        used: set[str] = set()
        while not all(t.done() for t in tasks):
            for i in range(len(tasks)):
                placement = policy.placement_of(f"up-{i}")
                if placement is not None:
                    used.add(placement.decode_worker_id)
            await asyncio.sleep(0.002)
        await asyncio.gather(*tasks)
        return used

    assert pools.run(land_on_each(), timeout_s=300) == set(decode_ids)

    async def scale_down_under_load() -> list[list[int]]:
        load = asyncio.ensure_future(
            generate_tokens(pools.router.grpc_endpoint, prompts, 48, timeout_s=180)
        )
        await asyncio.sleep(0.05)
        await pools.scale(PoolTargets(1, 1))
        tokens = await load
        await pools.wait_settled()
        return tokens

    assert pools.run(scale_down_under_load(), timeout_s=300) == reference
    assert len(pools.serving(WorkerRole.DECODE)) == 1
    assert {w.worker_id for w in pools.router.pool.workers} == set(pools.infos)
    assert_pools_idle(pools)


def test_drain_worker_finishes_its_streams_then_it_is_replaced(pools):
    """DrainWorker: nothing new is placed on it, its streams finish (no error), it
    leaves, and the owner starts a replacement to hold the target."""
    [victim] = pools.serving(WorkerRole.DECODE)
    prompt = make_prompts(2048, (25,), seed=83)[0]
    expected, _ = pools.run(
        stream_tokens(pools.router.grpc_endpoint, "drain-ref", prompt, max_tokens=150)
    )
    # The module's router counts the earlier tests' migrations too (a scale-down under
    # load may migrate what a drain does not finish in time).
    migrations_before = migrations_total(pools)

    async def scenario() -> list[int]:
        progress: dict[str, int] = {}
        task = asyncio.ensure_future(
            stream_tokens(pools.router.grpc_endpoint, "drain-1", prompt, progress, max_tokens=150)
        )
        while progress.get("drain-1", 0) < 3:
            await asyncio.sleep(0.002)
        async with grpc.aio.insecure_channel(pools.router.grpc_endpoint) as channel:
            stub = admin_pb2_grpc.AdminStub(channel)
            reply = await stub.DrainWorker(
                admin_pb.DrainWorkerRequest(worker_id=victim), metadata=GRPC_AUTH, timeout=10
            )
        assert {w.id: w.state for w in reply.workers}[victim] == WorkerLifecycle.DRAINING.value
        assert not pools.router.policy_runtime.policy.workers[victim].available
        tokens, _ = await task
        await pools.wait_settled()
        return tokens

    assert pools.run(scenario(), timeout_s=300) == expected
    assert victim not in pools.infos
    assert victim not in {w.worker_id for w in pools.router.pool.workers}
    assert migrations_total(pools) == migrations_before  # the drained stream finished there
    assert_pools_idle(pools)


def migrations_total(pools: InprocPools) -> float:
    return sum(migration_counts(pools.router).values())


def test_a_pools_owner_that_does_not_answer_is_unavailable_not_a_refusal(pools):
    """The pool controller gone (`tandem serve` killed): admin calls answer 503 /
    UNAVAILABLE, retriable, not 409 / FAILED_PRECONDITION as a refused change."""
    original = pools.get_pools

    async def gone() -> Membership:
        raise PoolsOwnerUnreachable("the pool controller is gone (its process died)")

    async def grpc_code() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(pools.router.grpc_endpoint) as channel:
            stub = admin_pb2_grpc.AdminStub(channel)
            try:
                await stub.GetPools(admin_pb.GetPoolsRequest(), metadata=GRPC_AUTH, timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    pools.get_pools = gone
    try:
        status, reply = pools.run(http(pools, "GET", "/admin/pools"))
        code = pools.run(grpc_code())
    finally:
        pools.get_pools = original
    assert status == 503 and "is gone" in reply["error"]["message"], reply
    assert reply["error"]["type"] == "server_error"
    assert code is grpc.StatusCode.UNAVAILABLE


def test_router_without_pool_controller_answers_unimplemented(cluster):
    """The shared cluster's router was given no AdminBackend."""

    async def scenario() -> tuple[int, dict, grpc.StatusCode]:
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                f"{cluster.http_endpoint}/admin/pools",
                headers={"Authorization": f"Bearer {SHARED_API_KEY}"},
            ) as response,
        ):
            status, body = response.status, await response.json()
        async with grpc.aio.insecure_channel(cluster.grpc_endpoint) as channel:
            stub = admin_pb2_grpc.AdminStub(channel)
            try:
                await stub.GetPools(
                    admin_pb.GetPoolsRequest(),
                    timeout=10,
                    metadata=(("authorization", f"Bearer {SHARED_API_KEY}"),),
                )
                code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
        return status, body, code

    status, body, code = cluster.run(scenario())
    assert status == 501 and "pool controller" in body["error"]["message"]
    assert code is grpc.StatusCode.UNIMPLEMENTED


def test_worker_that_disagrees_with_the_pools_is_refused(pools, tiny_model_dir, caplog):
    """A serving worker with another max model length never joins the router's pools
    (its requests could not be served alike); the others keep serving."""

    async def scenario() -> set[str]:
        engine = EngineConfig(
            model=str(tiny_model_dir), mode=WorkerRole.DECODE.engine_mode, num_threads=1,
            max_model_len=512, kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
        )  # fmt: skip
        server = DecodeWorker(WorkerConfig(worker_id="odd-0", role=WorkerRole.DECODE,
                                           engine=engine))  # fmt: skip
        endpoint = await server.start()
        try:
            pools.infos["odd-0"] = WorkerInfo(
                "odd-0", WorkerRole.DECODE, WorkerLifecycle.SERVING, endpoint=endpoint
            )
            await pools._publish()
            joined = {w.worker_id for w in pools.router.pool.workers}
            del pools.infos["odd-0"]
            await pools._publish()
        finally:
            await server.stop()
        return joined

    with caplog.at_level(logging.ERROR, logger="tandem.router.server"):
        joined = pools.run(scenario())
    assert any("odd-0 cannot join" in r.getMessage() and "max_model_len" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    assert "odd-0" not in joined and set(pools.infos) <= joined
    prompt = make_prompts(2048, (12,), seed=84)
    assert len(pools.run(generate_tokens(pools.router.grpc_endpoint, prompt, 8))[0]) == 8
    assert_pools_idle(pools)


def test_a_replacement_joins_before_the_worker_it_replaces_stops_taking_requests(pools):
    """The snapshot in which a replacement serves and the worker it replaces drains (the
    pool controller's make-before-break drain): the router joins the replacement (its
    Stats call, slowed here) before it stops placing on the other, so a decode worker
    is placeable throughout."""
    [old] = pools.serving(WorkerRole.DECODE)
    policy = pools.router.policy_runtime.policy
    original_stats = pools.router.pool.worker_stats

    async def scenario() -> list[bool]:
        new = await pools.start_worker(WorkerRole.DECODE)

        async def slow_stats(worker, timeout_s):
            if worker.worker_id == new.worker_id:
                await asyncio.sleep(0.5)
            return await original_stats(worker, timeout_s)

        placeable: list[bool] = []

        async def sample() -> None:
            while True:
                placeable.append(any(w.available for w in policy.workers.values()
                                     if w.role is WorkerRole.DECODE))  # fmt: skip
                await asyncio.sleep(0.005)

        pools.router.pool.worker_stats = slow_stats
        sampling = asyncio.create_task(sample())
        try:
            await pools.set_states(
                {new.worker_id: WorkerLifecycle.SERVING, old: WorkerLifecycle.DRAINING}
            )
            await asyncio.sleep(0.05)
        finally:
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)
            pools.router.pool.worker_stats = original_stats
        await pools.drain_and_stop(old)
        return placeable

    placeable = pools.run(scenario())
    assert len(placeable) > 20 and all(placeable), placeable.count(False)
    assert pools.serving(WorkerRole.DECODE) != [old]
    assert_pools_idle(pools)


def test_a_worker_slow_to_answer_stats_holds_up_no_other_workers_stats(pools):
    """The router polled its workers' Stats one after the other: a frozen worker (no
    answer until the 5 s probe timeout) held up every other worker's stats that long,
    every cycle. Now they are polled at once: the other worker's stats keep coming while
    the frozen worker's call is in flight."""
    [frozen] = pools.serving(WorkerRole.DECODE)
    [other] = pools.serving(WorkerRole.PREFILL)
    policy = pools.router.policy_runtime.policy
    original_stats, original_update = pools.router.pool.worker_stats, policy.update_stats
    # The other worker's updates taken while the frozen call was in flight.
    during_freeze: list[str] = []
    in_flight, thawed = asyncio.Event(), asyncio.Event()

    async def frozen_stats(worker, timeout_s):
        if worker.worker_id == frozen and not thawed.is_set():
            in_flight.set()
            # Under the probe timeout: the frozen worker still counts as reachable.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(thawed.wait(), 4.0)
            in_flight.clear()
        return await original_stats(worker, timeout_s)

    def counted_update(worker_id, stats, taken_at_s):
        if in_flight.is_set() and worker_id == other:
            during_freeze.append(worker_id)
        original_update(worker_id, stats, taken_at_s)

    async def scenario() -> None:
        pools.router.pool.worker_stats = frozen_stats
        policy.update_stats = counted_update
        try:
            await asyncio.wait_for(in_flight.wait(), 5.0)
            # Three of the other worker's 0.25 s polls, well within the freeze (polled one
            # after the other, it gets none until the frozen call returns).
            deadline = time.monotonic() + 3.5
            while len(during_freeze) < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            thawed.set()
            pools.router.pool.worker_stats = original_stats
            policy.update_stats = original_update

    pools.run(scenario())
    assert len(during_freeze) >= 3, during_freeze


def test_tandem_pools_shows_the_routers_predictions_in_milliseconds():
    worker = {"state": "serving", "node": "n", "pid": 1, "endpoint": "e", "running": 0,
              "waiting": 0, "kv_usage": 0.0}  # fmt: skip
    decode = {**worker, "id": "decode-0", "role": "decode"}
    prefill = {**worker, "id": "prefill-0", "role": "prefill"}
    view = {
        "workers": [
            {**decode, "predicted_step_s": 0.0123, "predicted_queue_s": 0.0},
            {**prefill, "predicted_step_s": 0.0, "predicted_queue_s": 0.25},
            # From the pool controller (`tandem pools --ray-address`): no router, none.
            {**prefill, "id": "prefill-1"},
        ],
        "targets": {"prefill": 2, "decode": 1},
    }
    header, decode_row, prefill_row, controller_row, _ = format_table(view).splitlines()
    assert header.split()[-2:] == ["step_ms", "queue_ms"]
    assert decode_row.split()[-1] == "12.3"  # no queue: blank
    assert prefill_row.split()[-1] == "250.0"  # no step: blank
    assert controller_row.split()[-1] == "0%"
