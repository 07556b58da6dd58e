"""The Helm chart over its values matrix (`helm/tandem/ci/*.yaml`), rendered offline by
the real Helm engine: strict lint, Kubernetes 1.30 strict validation of every built-in
object, the RayCluster against the KubeRay schema in `schemas/`, what the objects say,
and golden snapshots.

Update the snapshots after an intended change (then review the diff):

    TANDEM_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/deploy/test_chart_render.py
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tandem.cluster.config import role_resource
from tandem.worker.config import WorkerRole
from tests.helpers.helm_chart import (
    CASES,
    ROOT,
    case_values,
    lint,
    manifests,
    merged_values,
    release_name,
    render,
    render_case,
)

pytestmark = pytest.mark.timeout(120)

KUBE_VERSION = "1.30.0"
SNAPSHOTS = Path(__file__).parent / "snapshots"
RAYCLUSTER_SCHEMA = json.loads(
    (Path(__file__).parent / "schemas" / "raycluster.ray.io_v1.json").read_text()
)
# Kinds each case renders (the report's matrix); a change here is a change of the chart.
EXPECTED_KINDS = {
    "autoscaling-monitoring": [
        "ConfigMap", "Deployment", "PodDisruptionBudget", "PodMonitor", "PrometheusRule",
        "RayCluster", "Service", "ServiceMonitor",
    ],
    "cpu-hostpath": ["Deployment", "RayCluster", "Service"],
    "default": ["Deployment", "PodDisruptionBudget", "RayCluster", "Service"],
    "download-auth": [
        "ConfigMap", "Deployment", "NetworkPolicy", "NetworkPolicy", "PodDisruptionBudget",
        "RayCluster", "Service",
    ],
    "long-names": ["Deployment", "PodDisruptionBudget", "RayCluster", "Service"],
}  # fmt: skip
BUILT_IN_GROUPS = {"v1", "apps/v1", "policy/v1", "networking.k8s.io/v1"}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@pytest.fixture(scope="module", params=CASES)
def case(request: pytest.FixtureRequest) -> tuple[str, dict[str, str], list[dict[str, Any]]]:
    rendered, objects = render_case(request.param)
    return request.param, rendered, objects


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def test_the_values_matrix_is_what_the_report_lists():
    assert sorted(EXPECTED_KINDS) == CASES


@pytest.mark.parametrize("name", CASES)
def test_strict_lint_finds_nothing(name: str):
    findings = lint(case_values(name), kube_version=f"v{KUBE_VERSION}")
    assert [f for f in findings if f["severity"] >= 2] == []


def test_rendered_kinds(case):
    name, _, objects = case
    assert sorted(o["kind"] for o in objects) == EXPECTED_KINDS[name]


def test_built_in_objects_are_valid_kubernetes_1_30(case):
    name, _, objects = case
    built_in = [o for o in objects if o["apiVersion"] in BUILT_IN_GROUPS]
    for obj in built_in:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    # Everything but the RayCluster and the Prometheus Operator objects is built in.
    custom = {"RayCluster", "ServiceMonitor", "PodMonitor", "PrometheusRule"}
    assert len(built_in) == len([k for k in EXPECTED_KINDS[name] if k not in custom])


def test_raycluster_matches_kuberay_api_and_its_pods_are_valid(case):
    _, _, objects = case
    [cluster] = by_kind(objects, "RayCluster")
    jsonschema.validate(cluster, RAYCLUSTER_SCHEMA)
    spec = cluster["spec"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": "check"},
            "template": group["template"],
        }
        kubernetes_validate.validate(pod_template, KUBE_VERSION, strict=True)


def test_worker_groups_follow_the_pool_values(case):
    name, _, objects = case
    values = merged_values(name)
    [cluster] = by_kind(objects, "RayCluster")
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert sorted(groups) == ["decode", "prefill"]
    assert cluster["spec"]["rayVersion"] == values["ray"]["version"]
    assert cluster["spec"]["enableInTreeAutoscaling"] is values["ray"]["autoscaling"]["enabled"]
    for role in (WorkerRole.PREFILL, WorkerRole.DECODE):
        pool, group = values[role.value], groups[role.value]
        assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (
            pool["replicas"], pool["minReplicas"], pool["maxReplicas"],
        )  # fmt: skip
        # The Ray resource the pool controller's worker actors ask for (one per pod).
        advertised = json.loads(json.loads(group["rayStartParams"]["resources"]))
        assert advertised == {role_resource(role): 1}
        [container] = group["template"]["spec"]["containers"]
        resources = container["resources"]
        for part in ("requests", "limits"):
            assert resources[part].get("nvidia.com/gpu", 0) == pool["gpus"]
            assert resources[part]["cpu"] == str(pool["resources"]["cpu"])


def test_head_runs_tandem_serve_with_the_pool_targets(case):
    name, _, objects = case
    values = merged_values(name)
    [cluster] = by_kind(objects, "RayCluster")
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    [head] = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    script = head["args"][0]
    assert "$KUBERAY_GEN_RAY_START_CMD &" in script
    [serve_line] = [line for line in script.splitlines() if line.startswith("tandem serve")]
    argv = shlex.split(serve_line.removesuffix("&"))
    from tandem.cluster.cli import build_parser

    # Every flag parses with the real `tandem serve` parser.
    args = build_parser().parse_args(argv[1:])
    # The planner's mode is always named (`tandem serve`'s own default is observe).
    planner = values["planner"]
    assert args.planner == planner["mode"]
    if planner["mode"] != "off":
        assert args.planner_interval == planner["interval"]
        assert args.max_workers == planner["maxWorkers"]
    assert args.prefill == values["prefill"]["replicas"]
    assert args.decode == values["decode"]["replicas"]
    assert args.model == f"{values['model']['mountPath']}/{values['model']['name']}"
    assert args.device == ("cuda" if values["prefill"]["gpus"] else "cpu")
    assert args.autoscaling and args.ray_address == "auto"
    assert args.pool_metrics_port == values["metrics"]["poolControllerPort"]
    assert args.max_workers_per_role == max(
        values["prefill"]["maxReplicas"], values["decode"]["maxReplicas"]
    )


def head_serve_args(values: dict[str, Any]) -> Any:
    """The head's `tandem serve` command line for `values`, parsed by the real parser."""
    [cluster] = by_kind(manifests(render(values)), "RayCluster")
    [head] = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    [serve_line] = [
        line for line in head["args"][0].splitlines() if line.startswith("tandem serve")
    ]
    from tandem.cluster.cli import build_parser

    return build_parser().parse_args(shlex.split(serve_line.removesuffix("&"))[1:])


def test_large_engine_numbers_reach_tandem_serve_as_integers():
    """Values files give numbers as floats; from a million on, Helm's toString writes
    them as 1e+06, which `tandem serve` refuses (the head would crash-loop)."""
    engine = {"maxModelLen": 1048576, "maxNumBatchedTokens": 1000000,
              "maxLocalPrefillTokens": 2000000}  # fmt: skip
    values = {"prefill": {"engineArgs": engine}, "decode": {"engineArgs": engine}}
    args = head_serve_args(values)
    assert (args.max_model_len, args.max_num_batched_tokens, args.max_local_prefill_tokens) == (
        1048576, 1000000, 2000000,
    )  # fmt: skip


def test_engine_args_reach_tandem_serve():
    engine = {"dtype": "bfloat16", "attentionBackend": "torch", "cudaGraphs": "off",
              "stepWatchdogSeconds": 900, "threads": 3}  # fmt: skip
    values = {"prefill": {"engineArgs": engine}, "decode": {"engineArgs": engine}}
    args = head_serve_args(values)
    assert (args.dtype, args.attention_backend, args.cuda_graphs, args.step_watchdog,
            args.threads) == ("bfloat16", "torch", "off", 900.0, 3)  # fmt: skip


def test_the_generation_config_choice_reaches_tandem_serve():
    assert head_serve_args({}).generation_config == "auto"
    assert head_serve_args({"router": {"generationConfig": "off"}}).generation_config == "off"
    with pytest.raises(Exception, match="generationConfig"):
        render({"router": {"generationConfig": "model"}})


def test_the_worker_restart_backoff_reaches_tandem_serve():
    assert head_serve_args({}).restart_backoff == 2.0
    values = {"ray": {"head": {"workerRestartBackoffSeconds": 0}}}
    assert head_serve_args(values).restart_backoff == 0.0
    with pytest.raises(Exception, match="workerRestartBackoffSeconds"):
        render({"ray": {"head": {"workerRestartBackoffSeconds": -1}}})


def test_an_idle_timeout_of_zero_is_kept():
    """0 (scale idle pods down at once) is a value; `default` would make it 60."""
    values = {"ray": {"autoscaling": {"enabled": True, "idleTimeoutSeconds": 0}}}
    [cluster] = by_kind(manifests(render(values)), "RayCluster")
    assert cluster["spec"]["autoscalerOptions"]["idleTimeoutSeconds"] == 0


def test_a_probe_set_to_null_falls_back_to_kubernetes_timing():
    """`--set router.probes.readiness=null` drops the timing, not the probe (it rendered
    a bare `null` inside the probe: YAML no parser takes)."""
    values = {"router": {"probes": {"readiness": None, "liveness": None}}}
    [deployment] = by_kind(manifests(render(values)), "Deployment")
    kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"] == {"httpGet": {"path": "/health", "port": "http"}}
    assert set(container["livenessProbe"]) == {"grpc"}


def test_metrics_scrapers_reach_only_the_http_port_of_a_closed_router():
    prometheus = {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}
    clients = [{"podSelector": {"matchLabels": {"app": "chat"}}}]
    values = {"networkPolicy": {"enabled": True, "metricsScrapers": [prometheus]}}
    closed = dict(values, networkPolicy={**values["networkPolicy"], "allowedClients": clients})
    rules = {}
    for name, given in (("open", values), ("closed", closed)):
        policies = by_kind(manifests(render(given)), "NetworkPolicy")
        [router] = [p for p in policies if p["metadata"]["name"].endswith("router")]
        kubernetes_validate.validate(router, KUBE_VERSION, strict=True)
        rules[name] = router["spec"]["ingress"]
    # Open to anyone: nothing to add. Closed: the clients on both ports, Prometheus on HTTP.
    assert rules["open"] == [{"ports": [{"port": 50051, "protocol": "TCP"},
                                        {"port": 8000, "protocol": "TCP"}]}]  # fmt: skip
    assert rules["closed"][0]["from"] == clients
    assert rules["closed"][1] == {"ports": [{"port": 8000, "protocol": "TCP"}],
                                  "from": [prometheus]}  # fmt: skip


def test_router_joins_the_ray_cluster_and_serves_both_ports(case):
    name, _, objects = case
    values = merged_values(name)
    [deployment] = by_kind(objects, "Deployment")
    [cluster] = by_kind(objects, "RayCluster")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    command = " ".join(container["args"])
    head = f"{cluster['metadata']['name']}-head-svc.llm.svc.cluster.local:6379"
    assert f"ray start --address={head}" in command
    assert "tandem router --ray-address auto" in command
    assert deployment["spec"]["replicas"] == values["router"]["replicas"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["grpc"]["port"] == values["router"]["service"]["grpcPort"]
    services = [s for s in by_kind(objects, "Service") if s["metadata"]["name"].endswith("router")]
    ports = {p["name"]: p["port"] for p in services[0]["spec"]["ports"]}
    assert ports == {"grpc": 50051, "http": 8000}


def test_names_and_labels_stay_valid(case):
    name, _, objects = case
    for obj in objects:
        object_name = obj["metadata"]["name"]
        assert len(object_name) <= 63 and DNS_LABEL.match(object_name), object_name
        for value in obj["metadata"].get("labels", {}).values():
            assert len(value) <= 63 and LABEL_VALUE.match(value), value
    [cluster] = by_kind(objects, "RayCluster")
    # KubeRay names worker pods "<cluster>-<group>-worker-<5 chars>".
    assert len(f"{cluster['metadata']['name']}-prefill-worker-abcde") <= 63
    if name == "long-names":
        assert release_name(name) not in cluster["metadata"]["name"]


def test_monitoring_objects_ship_the_tested_rules_and_board(case):
    _, _, objects = case
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yaml").read_text())
    for rule in by_kind(objects, "PrometheusRule"):
        assert rule["spec"] == rules
    board = json.loads((ROOT / "deploy" / "grafana" / "tandem.json").read_text())
    for config_map in by_kind(objects, "ConfigMap"):
        if "tandem.json" in config_map.get("data", {}):
            assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
            assert json.loads(config_map["data"]["tandem.json"]) == board


def test_notes_give_the_first_request(case):
    name, rendered, _ = case
    notes = rendered["tandem/templates/NOTES.txt"]
    assert (
        "/v1/completions" in notes
        and case_values(name).get("model", {}).get("name", "tandem-small") in notes
    )


def test_golden_snapshot(case):
    name, rendered, _ = case
    text = "".join(
        f"# Source: {path}\n{body.strip()}\n---\n"
        for path, body in sorted(rendered.items())
        if body.strip()
    )
    path = SNAPSHOTS / f"{name}.yaml"
    if os.environ.get("TANDEM_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no snapshot {path}: run with TANDEM_UPDATE_SNAPSHOTS=1"
    assert text == path.read_text(), (
        f"{name}: the rendered chart differs from {path.relative_to(ROOT)}; if intended, "
        "TANDEM_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/deploy/test_chart_render.py"
    )
