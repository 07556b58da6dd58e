"""The Grafana board and the recording rules against real data: a real Prometheus
server scrapes a running cluster (router in this process, pool controller and workers as
Ray actors) while it serves load, and every panel query of deploy/grafana/tandem.json and
every recording rule of deploy/prometheus/rules.yaml must return data through
Prometheus' HTTP API: no "No data" panel, no metric name that nothing exports.

Targets carry the labels the chart's monitors add (`namespace` and `model_name` on all;
a series' own `model_name`, a router's, is kept). The router and the pool controller
both export the pool gauges, and the planner's go to both: every count must still come
out once."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import shutil
import time
from pathlib import Path

import pytest
import ray
import yaml

from tandem.cluster.launcher import LocalCluster
from tandem.cluster.serve import start_planner
from tandem.cluster.traffic import ClusterTraffic
from tandem.planner.live_config import PlannerConfig, PlannerMode
from tests.helpers.grpc_calls import generate_tokens
from tests.helpers.helm_chart import ROOT
from tests.helpers.prometheus_server import PrometheusServer
from tests.helpers.prompts import make_prompts
from tests.helpers.ray_pools import assert_idle, cluster_config, init_ray_with_role_slots
from tests.helpers.waiting import run_bounded

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None,
        reason="prometheus not installed (Debian package `prometheus`; .ci/run installs it)",
    ),
]

NAMESPACE = "tandem-test"
# Stands in for Grafana's $__rate_interval: a few 1 s scrapes.
RATE_WINDOW = "20s"
# The live planner (observe) plans this often beside the router, as `tandem serve` runs it.
PLANNER = PlannerConfig(
    mode=PlannerMode.OBSERVE, interval_s=2.0, min_requests=3, num_sim_requests=30
)
BOARD = json.loads((ROOT / "deploy" / "grafana" / "tandem.json").read_text())
RULES_FILE = ROOT / "deploy" / "prometheus" / "rules.yaml"
RULES = yaml.safe_load(RULES_FILE.read_text())
METRIC_NAME = re.compile(r"\btandem:[a-z_:]+[a-z_]")


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target."""
    return [
        (panel["title"], target["expr"])
        for panel in BOARD["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


def recording_rules() -> list[str]:
    return [rule["record"] for group in RULES["groups"] for rule in group["rules"]
            if "record" in rule]  # fmt: skip


def with_variables(expr: str, model: str) -> str:
    """The query Grafana sends with namespace and model chosen."""
    return (
        expr.replace("$__rate_interval", RATE_WINDOW)
        .replace("$namespace", NAMESPACE)
        .replace("$model", model)
    )


def test_the_board_has_no_hard_coded_uids_or_namespaces():
    text = json.dumps(BOARD)
    uids = set(re.findall(r'"uid": "([^"]*)"', text))
    assert uids == {"${datasource}"}
    assert "uid" not in BOARD and "id" not in BOARD
    names = [v["name"] for v in BOARD["templating"]["list"]]
    assert names == ["datasource", "namespace", "model"]
    ids = [panel["id"] for panel in BOARD["panels"]]
    assert len(ids) == len(set(ids))
    for panel in BOARD["panels"]:
        refs = [target["refId"] for target in panel.get("targets", [])]
        assert len(refs) == len(set(refs)), panel["title"]
    for _, expr in panel_queries():
        assert 'namespace=~"$namespace"' in expr, expr
        assert 'namespace="' not in expr, expr


@pytest.fixture(scope="module")
def ray_session():
    init_ray_with_role_slots()
    yield
    ray.shutdown()


def test_every_panel_and_recording_rule_has_data_under_load(
    ray_session: None, tiny_model_dir: Path, tmp_path: Path
):
    async def scenario() -> None:
        # Prometheus first: it takes a few seconds to apply targets, overlapping the
        # cluster's start.
        prometheus = PrometheusServer(tmp_path, ["router", "ray"], [RULES_FILE])
        prometheus.start()
        config = cluster_config(tiny_model_dir)
        config.planner = PLANNER
        cluster = LocalCluster(config)
        planner = None
        try:
            router = await cluster.start()
            planner = await start_planner(config, router, ClusterTraffic(cluster.controller_link))
            membership = await cluster.membership()
            model = router.config.model_name
            prometheus.set_targets(
                "router",
                [f"{router.http_endpoint}/metrics"],
                {"namespace": NAMESPACE, "model_name": model},
            )
            ray_targets = [w.metrics_url for w in membership.workers]
            ray_targets.append(cluster.controller_metrics_url)
            prometheus.set_targets(
                "ray", ray_targets, {"namespace": NAMESPACE, "model_name": model}
            )
            # Blocking calls run in a thread: the router serves /metrics on this loop.
            wait_for = functools.partial(asyncio.to_thread, prometheus.wait_for)
            await wait_for("count(up == 1) == 4", 20, "the first scrape of every target")
            # Load in waves across several scrapes: short prompts (local prefill may take
            # them) and longer ones (prefilled remotely, KV pulled).
            num_requests = 0
            for wave in range(3):
                prompts = make_prompts(2048, (6, 40, 90, 12, 64, 120), seed=100 + wave)
                await generate_tokens(router.grpc_endpoint, prompts, 12)
                num_requests += len(prompts)
                await asyncio.sleep(1.0)
            await wait_for(
                f'sum(tandem:request_success_total{{namespace="{NAMESPACE}"}}) >= {num_requests}',
                20, "the last requests scraped",
            )  # fmt: skip
            # From the pool controller (job "ray"): where Kubernetes scrapes it.
            from_controller = f'{{namespace="{NAMESPACE}", job="ray"}}'
            await wait_for(
                f"count(tandem:planner_recommended_workers{from_controller}) == 2",
                90, "the live planner's first recommendation scraped from the controller",
            )  # fmt: skip
            # A rule evaluation after that scrape (every 1 s).
            scraped_at = time.time()
            await wait_for(
                f'timestamp(namespace_model:tandem_requests:rate5m{{namespace="{NAMESPACE}"}})'
                f" > {scraped_at:.3f}",
                10, "a rule evaluation after the last scrape",
            )  # fmt: skip
            await asyncio.to_thread(check_panels_and_rules, prometheus, model)
            await assert_idle(await cluster.membership())
        finally:
            prometheus.stop()
            if planner is not None:
                await planner.stop()
            await cluster.stop()

    # Under the test's timeout: a hang fails showing where each task waits.
    run_bounded(scenario(), 200.0)


def check_panels_and_rules(prometheus: PrometheusServer, model: str) -> None:
    exported = set(prometheus.api("label/__name__/values"))
    recorded = set(recording_rules())
    referenced = {name for _, expr in panel_queries() for name in METRIC_NAME.findall(expr)} | {
        name
        for group in RULES["groups"]
        for rule in group["rules"]
        for name in METRIC_NAME.findall(rule["expr"])
    }
    missing = referenced - exported - recorded
    assert not missing, f"metric names nothing exports: {sorted(missing)}"

    no_data: list[str] = []
    checked = 0
    for title, expr in panel_queries():
        result = prometheus.query(with_variables(expr, model))
        checked += 1
        if not result:
            no_data.append(f"{title}: {expr}")
    for record in recording_rules():
        result = prometheus.query(f'{record}{{namespace="{NAMESPACE}"}}')
        checked += 1
        if not result:
            no_data.append(f"recording rule {record}")
    assert not no_data, "No data:\n" + "\n".join(no_data)
    assert checked == len(panel_queries()) + len(recorded)

    # The template variables find this cluster.
    for label, value in (("namespace", NAMESPACE), ("model_name", model)):
        values = prometheus.api(
            f"label/{label}/values", **{"match[]": "tandem:num_requests_running"}
        )
        assert value in values, (label, values)
    # And the numbers mean something: requests finished, one worker serves in each pool
    # (the router's copy of the pool gauges and the controller's count once), as the board
    # shows it too.
    serving = prometheus.query(
        f'namespace_model_role:tandem_serving_workers:max{{namespace="{NAMESPACE}"}}'
    )
    assert sorted((s["metric"]["role"], float(s["value"][1])) for s in serving) == [
        ("decode", 1.0), ("prefill", 1.0),
    ]  # fmt: skip
    [pools_panel] = [
        expr
        for title, expr in panel_queries()
        if title.startswith("Workers per role") and "pool_workers" in expr
    ]
    shown = prometheus.query(with_variables(pools_panel, model))
    assert sorted((s["metric"]["role"], float(s["value"][1])) for s in shown) == [
        ("decode", 1.0), ("prefill", 1.0),
    ]  # fmt: skip
