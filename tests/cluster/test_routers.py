"""Several routers on one cluster behind a cluster token: `tandem router --ray-address`
as its own process serves, follows a scale event made through the first router, and
re-exports the same pool gauges that `/admin/pools` and the controller show; a router
without the token is refused by the workers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
import pytest
import ray

from tandem.cluster.cli import main
from tandem.cluster.config import ClusterConfig
from tandem.cluster.launcher import LocalCluster
from tandem.cluster.router_process import serving_endpoints
from tandem.planner.observe import Counters, read_router_counters
from tandem.proto.cluster_auth import ClusterAuth, generate_token
from tandem.router.server import Router
from tests.helpers.grpc_calls import generate_tokens
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.parallel import DISRUPTS_ITS_CLUSTER
from tests.helpers.prompts import make_prompts
from tests.helpers.ray_pools import (
    admin_pool_counts,
    assert_idle,
    cluster_config,
    init_ray_with_role_slots,
    metrics_pool_counts,
    scrape,
    until,
)
from tests.helpers.tandem_command import RouterCommand

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow, DISRUPTS_ITS_CLUSTER]

MAX_TOKENS = 12


def admin_view(http_endpoint: str) -> dict:
    with urllib.request.urlopen(f"{http_endpoint}/admin/pools", timeout=10) as reply:
        return json.loads(reply.read())


def refusals(metrics_url: str) -> float:
    return sum(
        value
        for name, value in scrape(metrics_url).items()
        if name.startswith("tandem:unauthenticated_requests_total")
    )


async def stop_both(router: RouterCommand | None, cluster: LocalCluster) -> None:
    """The router command by SIGTERM, as Kubernetes stops a router pod (a clean drain
    and exit 0), then the cluster."""
    if router is not None:
        stopped = await asyncio.to_thread(router.stop, 60.0, signal.SIGTERM)
        assert stopped == 0, router.output
    await cluster.stop()


def run_on_ray(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    init_ray_with_role_slots()
    try:
        asyncio.run(scenario())
    finally:
        ray.shutdown()


def test_second_router_command_serves_and_follows_a_scale_event(tiny_model_dir, tmp_path,
                                                              capsys):  # fmt: skip
    prompts = make_prompts(2048, (9, 40, 75), seed=31)
    expected = hf_greedy(tiny_model_dir, prompts, MAX_TOKENS)
    config = with_new_token(cluster_config(tiny_model_dir))
    auth = config.worker.cluster_auth

    async def scenario() -> None:
        cluster = LocalCluster(config)
        second = None
        try:
            first = await cluster.start()
            second = RouterCommand(cluster.ray_address, tmp_path / "router.log")
            await asyncio.to_thread(second.wait_ready)
            assert await generate_tokens(second.grpc_endpoint, prompts, MAX_TOKENS) == expected

            # The pool controller sums every router's traffic (what the live planner beside
            # the first router reads): these requests went through the second one only.
            def seen(traffic: Counters) -> tuple[float, ...]:
                return (traffic.first_tokens, traffic.prompt_tokens,
                        traffic.generation_tokens, traffic.finished)  # fmt: skip

            want_seen = (3, sum(map(len, prompts)), 3 * MAX_TOKENS, 3)
            deadline = asyncio.get_running_loop().time() + 15.0
            while seen(traffic := await cluster.controller.traffic.remote()) != want_seen:
                assert asyncio.get_running_loop().time() < deadline, traffic
                await asyncio.sleep(0.2)
            assert read_router_counters(first).first_tokens == 0
            # What the live planner beside the first router publishes (its gauges and its
            # /admin/pools view) reaches the second one with the answer to its report:
            # `tandem pools` through any router shows the recommendation.
            view = {"mode": "observe", "budget": 2, "recommended": {"prefill": 1, "decode": 1},
                    "reason": "1P+1D sustains 3 req/s", "last_action": "observe mode"}  # fmt: skip
            await cluster.controller.publish_plan.remote((1, 1), 2.5, 2.0, view)
            await until(
                lambda: admin_view(second.http_endpoint).get("planner") == view, 15.0,
                "the planner's view on the second router",
            )  # fmt: skip
            capsys.readouterr()
            pools_b = ["pools", "--address", second.http_endpoint.removeprefix("http://")]
            assert await asyncio.to_thread(main, pools_b) == 0
            assert "planner (observe): recommends 1 prefill + 1 decode" in capsys.readouterr().out

            # A scale event through the first router ...
            http_a = first.http_endpoint.removeprefix("http://")
            scale = ["scale", "--prefill", "1", "--decode", "2", "--address", http_a,
                     "--timeout", "120"]  # fmt: skip
            assert await asyncio.to_thread(main, scale) == 0, capsys.readouterr().err
            want = ({("prefill", "serving"): 1, ("decode", "serving"): 2},
                    {"prefill": 1, "decode": 2})  # fmt: skip
            # ... reaches the second one through its own watcher (its gauges follow the
            # membership it applied), and every view agrees. (Blocking HTTP calls go
            # through a thread: the first router serves from this event loop.)
            second_metrics = f"{second.http_endpoint}/metrics"
            await until(
                lambda: metrics_pool_counts(scrape(second_metrics)) == want, 30.0,
                "the second router's gauges at 1P+2D",
            )  # fmt: skip
            for http in (first.http_endpoint, second.http_endpoint):
                assert admin_pool_counts(await asyncio.to_thread(admin_view, http)) == want
                gauges = await asyncio.to_thread(scrape, f"{http}/metrics")
                assert metrics_pool_counts(gauges) == want
                assert gauges['tandem:worker_restarts_total{role="decode"}'] == 0
            assert metrics_pool_counts(scrape(cluster.controller_metrics_url)) == want
            capsys.readouterr()
            http_b = second.http_endpoint.removeprefix("http://")
            assert await asyncio.to_thread(main, ["pools", "--address", http_b, "--json"]) == 0
            assert admin_pool_counts(json.loads(capsys.readouterr().out)) == want
            assert await generate_tokens(second.grpc_endpoint, prompts, MAX_TOKENS) == expected
            # A refusal through the second router names the field.
            refused = ["scale", "--prefill", "1", "--decode", "9", "--address", http_b]
            assert await asyncio.to_thread(main, refused) == 2
            assert "decode" in capsys.readouterr().err

            # A router that lacks the token: every worker refuses it.
            membership = await cluster.membership()
            before = sum(refusals(w.metrics_url) for w in membership.workers)
            stranger = Router(
                dataclasses.replace(config.router, cluster_auth=ClusterAuth()),
                serving_endpoints(membership),
            )
            with pytest.raises(grpc.aio.AioRpcError) as refusal:
                await stranger.start()
            await stranger.stop()
            assert refusal.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert sum(refusals(w.metrics_url) for w in membership.workers) > before
            await assert_idle(await cluster.controller.wait_at_target.remote(60.0), auth=auth)
        finally:
            await stop_both(second, cluster)

    run_on_ray(scenario)


def with_new_token(config: ClusterConfig) -> ClusterConfig:
    """`config` with a cluster token of its own (what `tandem serve` run without a token
    file generates at each start)."""
    auth = ClusterAuth(token=generate_token())
    return dataclasses.replace(
        config,
        worker=dataclasses.replace(config.worker, cluster_auth=auth),
        router=dataclasses.replace(config.router, cluster_auth=auth),
    )


def test_a_router_follows_a_restarted_pool_controller(tiny_model_dir, tmp_path):
    """`tandem serve` restarted on the same Ray cluster starts a new pool controller
    under the same name, and (without a token file) a new cluster token: a `tandem
    router` started before keeps serving, on the new workers with the new token, and
    its admin API answers from the new controller, with no restart. (With the old token
    every new worker refused it, for ever.)"""
    prompts = make_prompts(2048, (9, 40, 75), seed=32)
    expected = hf_greedy(tiny_model_dir, prompts, MAX_TOKENS)
    config = with_new_token(cluster_config(tiny_model_dir))

    def serves_two_workers(http_endpoint: str) -> bool:
        try:
            with urllib.request.urlopen(f"{http_endpoint}/health", timeout=10) as reply:
                return json.loads(reply.read())["workers"] == 2
        except urllib.error.HTTPError:  # 503 while it has no ready workers
            return False

    async def scenario() -> None:
        cluster = LocalCluster(config)
        router = None
        try:
            await cluster.start()
            router = RouterCommand(cluster.ray_address, tmp_path / "router.log")
            await asyncio.to_thread(router.wait_ready)
            assert await generate_tokens(router.grpc_endpoint, prompts, MAX_TOKENS) == expected
            first_owner = (await asyncio.to_thread(admin_view, router.http_endpoint))["owner"]
            await cluster.stop()

            restarted = with_new_token(config)
            cluster = LocalCluster(restarted)
            await cluster.start()
            new_pids = {w.pid for w in (await cluster.membership()).workers}
            # Its admin API answers from the new controller (another owner), its own view
            # follows it.
            view = await asyncio.to_thread(admin_view, router.http_endpoint)
            assert {w["pid"] for w in view["workers"]} == new_pids
            assert view["owner"] not in ("", first_owner)
            await until(
                lambda: serves_two_workers(router.http_endpoint), 30.0,
                "the router to serve the new controller's workers",
            )  # fmt: skip
            assert await generate_tokens(router.grpc_endpoint, prompts, MAX_TOKENS) == expected
            await assert_idle(await cluster.membership(), auth=restarted.worker.cluster_auth)
        finally:
            await stop_both(router, cluster)

    run_on_ray(scenario)
