"""Self-healing pools end to end: kill -9 under load, drain under load (several
routers: `test_routers.py`).

Real Ray actor workers, the real pool controller, routers that follow membership and
migrate requests. Every text is checked against `transformers` greedy generation;
every test ends with the pools at target and every worker idle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
import time
import urllib.error
import urllib.request

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.cluster.launcher import LocalCluster
from tandem.proto.tandem.v1 import generation_pb2 as gen_pb
from tandem.proto.tandem.v1 import generation_pb2_grpc
from tandem.router.membership import Membership, PoolTargets, WorkerLifecycle
from tests.helpers.grpc_calls import worker_stats
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.parallel import DISRUPTS_ITS_CLUSTER
from tests.helpers.prompts import make_prompts
from tests.helpers.ray_pools import (
    assert_idle,
    cluster_config,
    init_ray_with_role_slots,
    scrape,
    serving,
    until,
    wait_membership,
)

pytestmark = [
    DISRUPTS_ITS_CLUSTER,
    pytest.mark.timeout(420),
    pytest.mark.slow,
]

MAX_TOKENS = 48
PROMPT_LENS = (5, 17, 40, 64, 100, 150)


@pytest.fixture(scope="module")
def ray_session():
    init_ray_with_role_slots()
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(2048, PROMPT_LENS, seed=21)


@pytest.fixture(scope="module")
def expected(tiny_model_dir, prompts) -> list[list[int]]:
    return hf_greedy(tiny_model_dir, prompts, MAX_TOKENS)


def config_for(model_dir, num_prefill: int, num_decode: int):
    config = cluster_config(model_dir)
    config.pools = dataclasses.replace(config.pools, num_prefill=num_prefill,
                                       num_decode=num_decode)  # fmt: skip
    # Always through a prefill worker, so both roles carry every request.
    config.router = dataclasses.replace(config.router, max_local_prefill_tokens=0)
    return config


class Streams:
    """Greedy `Generate` streams that record tokens as they arrive."""

    def __init__(self, endpoint: str, prompts: list[list[int]], max_tokens: int) -> None:
        self.endpoint = endpoint
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.tokens: list[list[int]] = [[] for _ in prompts]

    async def run(self, timeout_s: float = 180.0) -> list[list[int]]:
        async with grpc.aio.insecure_channel(self.endpoint) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            await asyncio.gather(*(self._one(stub, i, timeout_s) for i in range(len(self.prompts))))
        return self.tokens

    async def _one(self, stub, i: int, timeout_s: float) -> None:
        request = gen_pb.GenerateRequest(
            prompt_token_ids=self.prompts[i], max_tokens=self.max_tokens, temperature=0.0
        )
        finished = False
        async for msg in stub.Generate(request, timeout=timeout_s):
            self.tokens[i] += msg.token_ids
            finished = finished or msg.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED
        assert finished, f"stream {i} ended without a finish reason"

    def all_started(self, min_tokens: int = 2) -> bool:
        return all(len(t) >= min_tokens for t in self.tokens)


async def busiest(membership: Membership, role: str):
    """The serving worker of `role` with the most requests in its engine now."""
    workers = serving(membership, role)
    stats = await asyncio.gather(*(worker_stats(w.endpoint, role) for w in workers))
    load = [s.num_running + s.num_waiting + s.num_held + s.num_importing for s in stats]
    return workers[load.index(max(load))]


def test_kill_9_decode_worker_with_streams_in_flight(ray_session, tiny_model_dir, prompts,
                                                     expected):  # fmt: skip
    async def scenario() -> None:
        cluster = LocalCluster(config_for(tiny_model_dir, 1, 2))
        try:
            await cluster.start()
            streams = Streams(cluster.router.grpc_endpoint, prompts, MAX_TOKENS)
            running = asyncio.create_task(streams.run())
            await until(streams.all_started, 60.0, "every stream's first tokens")
            victim = await busiest(await cluster.membership(), "decode")
            os.kill(victim.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            got = await asyncio.wait_for(running, 180.0)
            for i, (tokens, want) in enumerate(zip(got, expected, strict=True)):
                assert tokens == want, f"stream {i} differs from an uninterrupted run"
            # The streams may finish (migrated) before the controller's next probe.
            healed = await wait_membership(
                cluster,
                lambda m: (
                    len(serving(m, "decode")) == 2
                    and victim.worker_id not in {w.worker_id for w in serving(m, "decode")}
                ),
                timeout_s=60.0 - (time.monotonic() - killed_at),
                what="the pool back to 2 serving decode workers",
            )
            await assert_idle(healed, auth=cluster.config.worker.cluster_auth)
        finally:
            await cluster.stop()

    asyncio.run(scenario())


def test_a_dead_pool_controller_is_replaced_with_its_workers(ray_session, tiny_model_dir,
                                                             prompts, expected):  # fmt: skip
    """The controller's process killed (SIGKILL, as the OOM killer does): its workers die
    with it (Ray ends the actors an actor created). The cluster starts a new controller
    with the targets the old one had (2 decode workers here, scaled up from 1), the router
    follows it by name, and the streams in flight migrate to the new workers. Before,
    nothing answered again; then, after a SIGKILL (not `ray.kill`), the dead one's name
    stayed taken and no new controller could start."""

    async def scenario() -> None:
        cluster = LocalCluster(config_for(tiny_model_dir, 1, 1))
        try:
            await cluster.start()
            await cluster.controller.scale.remote(PoolTargets(prefill=1, decode=2))
            await cluster.controller.wait_at_target.remote(120.0)
            await until(
                lambda: getattr(cluster.kept_membership, "targets", None) == PoolTargets(1, 2),
                30.0, "the controller keeper to read the new targets",
            )  # fmt: skip
            streams = Streams(cluster.router.grpc_endpoint, prompts, MAX_TOKENS)
            running = asyncio.create_task(streams.run())
            await until(streams.all_started, 60.0, "every stream's first tokens")
            old = cluster.controller
            os.kill(await old.__ray_call__.remote(lambda _: os.getpid()), signal.SIGKILL)
            got = await asyncio.wait_for(running, 180.0)
            for i, (tokens, want) in enumerate(zip(got, expected, strict=True)):
                assert tokens == want, f"stream {i} differs from an uninterrupted run"
            await until(lambda: cluster.num_controller_restarts == 1, 60.0, "a new controller")
            assert cluster.controller != old
            healed = await cluster.controller.wait_at_target.remote(120.0)
            assert healed.targets == PoolTargets(prefill=1, decode=2)
            await assert_idle(healed, auth=cluster.config.worker.cluster_auth)
            # New requests are served too.
            again = Streams(cluster.router.grpc_endpoint, prompts[:2], MAX_TOKENS)
            assert await asyncio.wait_for(again.run(), 120.0) == expected[:2]
        finally:
            await cluster.stop()

    asyncio.run(scenario())


def test_kill_9_prefill_worker_with_queued_prompts(ray_session, tiny_model_dir):
    long_prompts = make_prompts(2048, (300, 280, 260, 240, 220, 200, 180, 160), seed=4)
    want = hf_greedy(tiny_model_dir, long_prompts, 8)

    async def scenario() -> None:
        cluster = LocalCluster(config_for(tiny_model_dir, 2, 1))
        try:
            await cluster.start()
            streams = Streams(cluster.router.grpc_endpoint, long_prompts, 8)
            running = asyncio.create_task(streams.run())
            membership = await cluster.membership()
            victim = None
            deadline = time.monotonic() + 30.0
            while victim is None and time.monotonic() < deadline and not running.done():
                candidate = await busiest(membership, "prefill")
                stats = await worker_stats(candidate.endpoint, "prefill")
                if stats.num_waiting + stats.num_running:
                    victim = candidate
            assert victim is not None, "no prefill worker ever had queued prompts"
            os.kill(victim.pid, signal.SIGKILL)
            got = await asyncio.wait_for(running, 180.0)
            assert got == want
            healed = await wait_membership(
                cluster,
                lambda m: (
                    len(serving(m, "prefill")) == 2
                    and victim.worker_id not in {w.worker_id for w in serving(m, "prefill")}
                ),
                timeout_s=60.0,
                what="the pool back to 2 serving prefill workers",
            )
            await assert_idle(healed, auth=cluster.config.worker.cluster_auth)
        finally:
            await cluster.stop()

    asyncio.run(scenario())


def _post_completion(http_endpoint: str, model: str) -> tuple[int, dict, float]:
    """(status, headers, seconds) of one small completion over HTTP."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    request = urllib.request.Request(
        f"{http_endpoint}/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    started = time.monotonic()
    try:
        # Placed on the dead worker, it waits for a replacement up to the router's 60 s
        # migration wait.
        with urllib.request.urlopen(request, timeout=90) as reply:
            return reply.status, dict(reply.headers), time.monotonic() - started
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), time.monotonic() - started


async def _grpc_health(endpoint: str) -> set[tuple[str, int]]:
    """(service, status) of the router's gRPC health for itself ("") and Generate."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        replies = [
            (service, await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5))
            for service in ("", "tandem.v1.Generation")
        ]
    return {(service, reply.status) for service, reply in replies}


def test_only_decode_worker_killed_gets_503_or_waits_then_recovers(ray_session, tiny_model_dir):
    """kill -9 of the only decode worker (1P + 1D): until the replacement serves, each
    request either gets 503 + Retry-After at once (placed when no decode worker was
    left) or, placed on the dead worker with its first token from the prefill worker,
    waits for the replacement and succeeds (test_migration.py tests each case alone);
    the pools heal with one decode restart and end idle."""

    async def scenario() -> None:
        cluster = LocalCluster(config_for(tiny_model_dir, 1, 1))
        try:
            await cluster.start()
            http, model = cluster.router.http_endpoint, cluster.config.router.model_name
            assert (await asyncio.to_thread(_post_completion, http, model))[0] == 200
            [decode] = serving(await cluster.membership(), "decode")
            os.kill(decode.pid, signal.SIGKILL)
            grpc_health: set[tuple[str, int]] = set()

            async def watch_grpc_health() -> None:
                while True:
                    grpc_health.update(await _grpc_health(cluster.router.grpc_endpoint))
                    await asyncio.sleep(0.1)

            watching = asyncio.create_task(watch_grpc_health())
            statuses = []
            deadline = time.monotonic() + 90.0
            while time.monotonic() < deadline:
                status, headers, took_s = await asyncio.to_thread(_post_completion, http, model)
                statuses.append(status)
                if status == 200:
                    break
                assert status == 503, f"got {status}, want 503 while no decode worker serves"
                assert "Retry-After" in headers
                assert took_s < 2.0, f"a 503 took {took_s:.1f} s; it must come at once"
                await asyncio.sleep(0.2)
            assert statuses[-1] == 200, statuses
            healed = await cluster.controller.wait_at_target.remote(60.0)
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
            # gRPC health: the public services went NOT_SERVING while no decode worker
            # served (a load balancer checking them stops sending); the server itself
            # stayed SERVING (liveness: the router is fine, and is not restarted).
            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            assert ("tandem.v1.Generation", not_serving) in grpc_health, grpc_health
            assert {status for service, status in grpc_health if service == ""} == {
                health_pb2.HealthCheckResponse.SERVING
            }
            assert decode.worker_id not in {w.worker_id for w in serving(healed, "decode")}
            assert (await cluster.controller.restarts.remote()) == {"prefill": 0, "decode": 1}
            await assert_idle(healed, auth=cluster.config.worker.cluster_auth)
        finally:
            await cluster.stop()

    asyncio.run(scenario())


class Load:
    """Client loops sending greedy requests until stopped; records every outcome."""

    def __init__(self, endpoint, prompts, expected, max_tokens: int, num_clients: int) -> None:
        self.endpoint, self.prompts, self.expected = endpoint, prompts, expected
        self.max_tokens, self.num_clients = max_tokens, num_clients
        self.done = 0
        self.wrong: list[int] = []
        self.errors: list[str] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self, timeout_s: float = 120.0) -> None:
        self._stop.set()
        await asyncio.wait_for(self._task, timeout_s)

    async def until_done(self, count: int, timeout_s: float, what: str) -> None:
        """Wait until `count` requests in all completed; AssertionError past `timeout_s`."""
        await until(lambda: self.done >= count, timeout_s, what)

    async def _run(self) -> None:
        rng = random.Random(0)
        async with grpc.aio.insecure_channel(self.endpoint) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            await asyncio.gather(*(self._client(stub, rng) for _ in range(self.num_clients)))

    async def _client(self, stub, rng: random.Random) -> None:
        while not self._stop.is_set():
            i = rng.randrange(len(self.prompts))
            request = gen_pb.GenerateRequest(
                prompt_token_ids=self.prompts[i], max_tokens=self.max_tokens, temperature=0.0
            )
            tokens: list[int] = []
            try:
                async for msg in stub.Generate(request, timeout=120):
                    tokens += msg.token_ids
            except grpc.aio.AioRpcError as exc:
                self.errors.append(f"{exc.code().name}: {exc.details()}")
                continue
            self.done += 1
            # Greedy: a shorter run is a prefix of the reference.
            if tokens != self.expected[i][: self.max_tokens]:
                self.wrong.append(i)


def test_scale_down_under_load_then_up(ray_session, tiny_model_dir, prompts, expected):
    async def scenario() -> None:
        cluster = LocalCluster(config_for(tiny_model_dir, 2, 2))
        try:
            await cluster.start()
            load = Load(cluster.router.grpc_endpoint, prompts, expected, MAX_TOKENS, 4)
            load.start()
            await load.until_done(4, 60.0, "requests under load")
            await cluster.controller.scale.remote(PoolTargets(prefill=1, decode=1))
            down = await cluster.controller.wait_at_target.remote(120.0)
            await load.stop()
            assert load.errors == [] and load.wrong == []
            loads = await cluster.controller.drained_loads.remote()
            assert len(loads) == 2
            for worker_id, last in loads.items():
                assert last.num_free_blocks == last.num_blocks, (
                    f"{worker_id} stopped holding blocks"
                )

            before = {w.worker_id for w in down.workers}
            await cluster.controller.scale.remote(PoolTargets(prefill=2, decode=2))
            up = await cluster.controller.wait_at_target.remote(120.0)
            new = [w for w in up.workers if w.worker_id not in before]
            assert sorted(w.role.value for w in new) == ["decode", "prefill"]
            # Enough requests that the new workers take some (the router learns of them
            # through its watcher; the policy spreads load).
            load = Load(cluster.router.grpc_endpoint, prompts, expected, 8, 4)
            load.start()
            await load.until_done(40, 120.0, "requests after scale-up")
            await load.stop()
            assert load.errors == [] and load.wrong == []
            for worker in new:
                metrics = scrape(worker.metrics_url)
                name = ("tandem:prefix_cache_queries_total" if worker.role == "prefill"
                        else "tandem:kv_transfer_bytes_total")  # fmt: skip
                took = sum(v for k, v in metrics.items() if k.startswith(name))
                assert took > 0, f"{worker.worker_id} took no traffic"
            # A decode worker keeps its transfer channel to a prefill worker that was
            # drained away until it has been idle for 60 s: one per prefill worker it
            # pulled from, here 3, never one per request.
            await assert_idle(up, max_channels=3, auth=cluster.config.worker.cluster_auth)
        finally:
            await cluster.stop()

    asyncio.run(scenario())


def test_draining_the_only_decode_worker_under_load_fails_no_request(
    ray_session, tiny_model_dir, prompts, expected
):
    """1P + 1D under load, the decode worker drained by name: it serves on until its
    replacement does, then drains (make before break), so with no other decode worker
    every request still completes with the right text; the drained worker stops idle."""

    async def scenario() -> None:
        cluster = LocalCluster(config_for(tiny_model_dir, 1, 1))
        try:
            await cluster.start()
            load = Load(cluster.router.grpc_endpoint, prompts, expected, MAX_TOKENS, 4)
            load.start()
            await load.until_done(4, 60.0, "requests under load")
            [old] = serving(await cluster.membership(), "decode")
            asked = await cluster.controller.drain.remote(old.worker_id)
            [named] = [w for w in asked.workers if w.worker_id == old.worker_id]
            assert (named.state, named.being_replaced) == (WorkerLifecycle.SERVING, True)
            done_at_drain = load.done
            final = await cluster.controller.wait_at_target.remote(120.0)
            await load.until_done(done_at_drain + 8, 60.0, "requests after the drain")
            await load.stop()
            assert load.errors == [], load.errors[:5]
            assert load.wrong == []
            [new] = serving(final, "decode")
            assert new.worker_id != old.worker_id
            loads = await cluster.controller.drained_loads.remote()
            assert list(loads) == [old.worker_id]
            assert loads[old.worker_id].is_idle
            assert loads[old.worker_id].num_free_blocks == loads[old.worker_id].num_blocks
            assert (await cluster.controller.restarts.remote()) == {"prefill": 0, "decode": 0}
            await assert_idle(final, auth=cluster.config.worker.cluster_auth)
        finally:
            await cluster.stop()

    asyncio.run(scenario())


def test_chaos_random_kills_under_steady_load(ray_session, tiny_model_dir, prompts, expected):
    """2P+2D under load; a random worker is killed, the pools heal, again (3 kills,
    bounded well under 3 minutes). A same-role peer is always alive, so every request
    must complete with the right text."""

    async def scenario() -> None:
        cluster = LocalCluster(config_for(tiny_model_dir, 2, 2))
        rng = random.Random(7)
        try:
            await cluster.start()
            load = Load(cluster.router.grpc_endpoint, prompts, expected, 24, 4)
            load.start()
            for _ in range(3):
                await load.until_done(load.done + 3, 60.0, "requests between kills")
                membership = await cluster.controller.wait_at_target.remote(60.0)
                # (A dead entry may still be listed for its retention: serving ones only.)
                live = [w for w in membership.workers if w.state is WorkerLifecycle.SERVING]
                victim = rng.choice(live)
                os.kill(victim.pid, signal.SIGKILL)
                await wait_membership(
                    cluster,
                    lambda m, v=victim: (
                        v.worker_id not in {x.worker_id for x in m.workers}
                        or {x.worker_id: x.state for x in m.workers}[v.worker_id]
                        is WorkerLifecycle.DEAD
                    ),
                    timeout_s=30.0,
                    what=f"{victim.worker_id} found dead",
                )
            final = await cluster.controller.wait_at_target.remote(60.0)
            await load.stop()
            assert load.errors == [], load.errors[:5]
            assert load.wrong == [] and load.done > 9
            restarts = await cluster.controller.restarts.remote()
            assert sum(restarts.values()) == 3
            await assert_idle(final, auth=cluster.config.worker.cluster_auth)
        finally:
            await cluster.stop()

    asyncio.run(scenario())


def test_a_decode_worker_killed_young_twice_in_a_row_is_restarted_after_the_backoff(
    ray_session, tiny_model_dir
):
    """Restart backoff through the real controller: the first kill -9 of a young decode
    worker is replaced at once, the second in a row only after `restart_backoff_s`
    (a crash loop is not restarted in a tight loop); the pools heal and end idle."""
    backoff_s = 5.0
    config = config_for(tiny_model_dir, 1, 1)
    config.pools = dataclasses.replace(config.pools, restart_backoff_s=backoff_s,
                                       restart_stable_s=600.0)  # fmt: skip

    async def kill_and_time_replacement(cluster: LocalCluster) -> tuple[float, Membership, float]:
        """kill -9 the serving decode worker; seconds from it being listed dead to a
        new decode worker being listed, the membership that first listed it dead, and
        when that was (Unix time)."""
        [victim] = serving(await cluster.controller.wait_at_target.remote(60.0), "decode")
        os.kill(victim.pid, signal.SIGKILL)

        def decode_ids(m: Membership) -> set[str]:
            return {w.worker_id for w in m.workers if w.role.value == "decode"}

        def dead(m: Membership) -> bool:
            states = {w.worker_id: w.state for w in m.workers}
            return states.get(victim.worker_id) is WorkerLifecycle.DEAD

        listed = await wait_membership(cluster, dead, 30.0, f"{victim.worker_id} found dead")
        found_dead_at, found_dead_unix_s = time.monotonic(), time.time()
        if decode_ids(listed) - {victim.worker_id}:
            return 0.0, listed, found_dead_unix_s  # its replacement was in the same membership
        await wait_membership(cluster, lambda m: bool(decode_ids(m) - decode_ids(listed)),
                              30.0, "a new decode worker")  # fmt: skip
        return time.monotonic() - found_dead_at, listed, found_dead_unix_s

    async def scenario() -> None:
        cluster = LocalCluster(config)
        try:
            await cluster.start()
            first, after_first, _ = await kill_and_time_replacement(cluster)
            second, after_second, second_dead_unix_s = await kill_and_time_replacement(cluster)
            # (The test sees the death up to a poll and a Ray call after the hold began.)
            assert first < backoff_s / 2, f"the first replacement waited {first:.1f} s"
            assert second >= backoff_s - 1.0, f"the second replacement waited {second:.1f} s"
            # The hold is in the membership (what /admin/pools and `tandem pools` show).
            assert after_first.restart_holds == {}
            hold = after_second.restart_holds["decode"]
            assert hold.failures == 2
            assert 0 < hold.until_unix_s - second_dead_unix_s <= backoff_s
            healed = await cluster.controller.wait_at_target.remote(60.0)
            assert healed.restart_holds == {}
            assert (await cluster.controller.restarts.remote()) == {"prefill": 0, "decode": 2}
            await assert_idle(healed, auth=cluster.config.worker.cluster_auth)
        finally:
            await cluster.stop()

    asyncio.run(scenario())
