"""Values the chart refuses, each with a message naming the field: the schema
(values.schema.json, checked by Helm as on `helm install`) for unknown keys, wrong
types and out-of-range numbers; the chart's own checks for what JSON Schema cannot
compare (minReplicas > maxReplicas, a GPU count that disagrees with `gpus`)."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from tests.helpers.helm_chart import CHART_DIR, render, render_case, validate_values

pytestmark = pytest.mark.timeout(60)


def refused(values: dict[str, Any]) -> str:
    """Helm's error for `values` (schema or template); fails when the chart accepts them."""
    import helm_python

    with pytest.raises(helm_python.HelmError) as error:
        validate_values(values)
        render(values)
    return str(error.value)


@pytest.mark.parametrize(
    ("values", "field", "why"),
    [
        ({"decode": {"replicaz": 2}}, "/decode", "replicaz"),
        ({"colour": "blue"}, "at ''", "'colour' not allowed"),
        ({"prefill": {"replicas": "two"}}, "/prefill/replicas", "string"),
        ({"decode": {"replicas": -1}}, "/decode/replicas", "minimum"),
        ({"decode": {"minReplicas": -2}}, "/decode/minReplicas", "minimum"),
        ({"router": {"service": {"grpcPort": 70000}}}, "/router/service/grpcPort", "maximum"),
        ({"model": {"source": "s3"}}, "/model/source", "one of 'pvc'"),
        ({"planner": {"mode": "sometimes"}}, "/planner/mode", "one of 'off'"),
        ({"prefill": {"resources": {"cpu": "8", "memory": "32Gi", "gpu": 1}}},
         "/prefill/resources", "gpu"),
        ({"prefill": {"engineArgs": {"maxModelLen": 0}}}, "/prefill/engineArgs/maxModelLen",
         "minimum"),
        ({"decode": {"engineArgs": {"kvCacheMemory": "lots"}}},
         "/decode/engineArgs/kvCacheMemory", "does not match"),
        # It is a label value too, which must end with a letter or digit.
        ({"model": {"name": "qwen-"}}, "/model/name", "does not match"),
        # `tandem serve` refuses an empty cache: the head would crash-loop.
        ({"decode": {"engineArgs": {"kvCacheMemory": "0Gi"}}},
         "/decode/engineArgs/kvCacheMemory", "does not match"),
        # The tag is image.tag's: "repo:1.0" would render "repo:1.0:<tag>".
        ({"image": {"repository": "ghcr.io/acme/tandem:1.0"}}, "/image/repository",
         "does not match"),
        ({"image": {"repository": "ghcr.io/acme/tandem@sha256:ab"}}, "/image/repository",
         "does not match"),
        ({"nameOverride": "Tandem_LLM"}, "/nameOverride", "does not match"),
        ({"auth": {"apiKeySecret": {"name": "keys", "key": "api/key"}}},
         "/auth/apiKeySecret/key", "does not match"),
    ],
)  # fmt: skip
def test_schema_refuses_with_the_field(values: dict[str, Any], field: str, why: str):
    message = refused(values)
    assert field in message and why in message, message


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"decode": {"minReplicas": 5, "maxReplicas": 2, "replicas": 2}},
         "decode.minReplicas (5) must be <= decode.maxReplicas (2)"),
        ({"prefill": {"replicas": 9}},
         "prefill.replicas (9) must be within [prefill.minReplicas, prefill.maxReplicas] = [1, 4]"),
        ({"decode": {"resources": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": 2}}},
         'decode.resources["nvidia.com/gpu"] (2) disagrees with decode.gpus (1)'),
        ({"prefill": {"gpus": 0}}, "prefill.gpus (0) and decode.gpus (1) must be equal"),
        ({"prefill": {"engineArgs": {"maxModelLen": 2048}}},
         "prefill.engineArgs and decode.engineArgs must be equal"),
        ({"model": {"source": "download"}}, "model.download.repo is required"),
        ({"prefill": {"gpus": 0, "engineArgs": {"kvBackend": "nccl"}},
          "decode": {"gpus": 0, "engineArgs": {"kvBackend": "nccl"}}},
         "prefill.engineArgs.kvBackend nccl needs gpus: 1"),
        ({"planner": {"mode": "observe", "maxWorkers": 9}},
         "planner.maxWorkers (9) must be <= twice the larger maxReplicas (4)"),
        ({"planner": {"mode": "observe", "maxWorkers": 3}, "decode": {"replicas": 3}},
         "planner.maxWorkers (3) must be >= prefill.replicas + decode.replicas"),
        ({"router": {"service": {"grpcPort": 8000, "httpPort": 8000}}},
         "router.service.grpcPort and httpPort must differ (both 8000)"),
        ({"metrics": {"poolControllerPort": 6379}},
         "metrics.poolControllerPort (6379) is one of the Ray head's ports"),
        ({"model": {"source": "pvc", "pvc": {"claimName": "models", "subPath": "/llama"}}},
         "model.pvc.subPath (/llama) must be a relative path without '..'"),
        ({"model": {"source": "pvc", "pvc": {"claimName": "models", "subPath": "a/../b"}}},
         "model.pvc.subPath (a/../b) must be a relative path without '..'"),
    ],
)  # fmt: skip
def test_chart_checks_refuse_with_a_message(values: dict[str, Any], message: str):
    assert message in refused(values)


def test_values_near_the_refused_ones_are_accepted():
    for values in (
        {"decode": {"engineArgs": {"kvCacheMemory": "0.5Gi"}},
         "prefill": {"engineArgs": {"kvCacheMemory": "0.5Gi"}}},
        {"image": {"repository": "registry.local:5000/acme/tandem"}},
        {"nameOverride": "llm-2"},
        {"model": {"source": "pvc", "pvc": {"claimName": "models", "subPath": "hub/llama..3"}}},
    ):  # fmt: skip
        validate_values(values)
        assert render(values)


def test_an_agreeing_gpu_entry_is_accepted():
    values = {"decode": {"resources": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": 1}}}
    validate_values(values)
    assert render(values)


def test_the_validators_catch_a_misspelt_field():
    """The render tests' validators can fail: a typo in a rendered object is refused."""
    _, objects = render_case("default")
    deployment = copy.deepcopy(next(o for o in objects if o["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.30.0", strict=True)
    import json
    from pathlib import Path

    schema = json.loads(
        (Path(__file__).parent / "schemas" / "raycluster.ray.io_v1.json").read_text()
    )
    cluster = copy.deepcopy(next(o for o in objects if o["kind"] == "RayCluster"))
    cluster["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        jsonschema.validate(cluster, schema)
    assert CHART_DIR.is_dir()


def object_nodes(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every sub-schema of type object, with its JSON path."""
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        if node.get("type") == "object":
            found.append((path or "/", node))
        for key, child in node.items():
            found += object_nodes(child, f"{path}/{key}")
    elif isinstance(node, list):
        for index, child in enumerate(node):
            found += object_nodes(child, f"{path}/{index}")
    return found


def test_schema_is_draft_07_and_closed_throughout():
    import json

    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    nodes = object_nodes(schema)
    assert len(nodes) > 40
    # Closed (false), a map of typed values, or the one open place: extraObjects,
    # which holds the user's own Kubernetes manifests.
    for path, node in nodes:
        assert "additionalProperties" in node, f"{path}: additionalProperties not set"
        if node["additionalProperties"] is True:
            assert path.startswith("/properties/extraObjects/"), path
