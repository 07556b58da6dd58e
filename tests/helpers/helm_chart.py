"""Renders the Helm chart `helm/tandem` offline with the real Helm engine (the
`helm-python-sdk` wheel: Helm v4's Go SDK behind a C ABI, no `helm` binary) over the
values files in `helm/tandem/ci/`.

Each case is rendered with the release name `RELEASE` except the long-names case,
which gets the longest release name Helm accepts (53 characters).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = ROOT / "helm" / "tandem"
NAMESPACE = "llm"
RELEASE = "tandem"
LONG_RELEASE = "tandem-serving-for-the-research-org-production-eu-001"  # 53 characters
# Case name: the values file's stem without "-values".
CASES = sorted(path.stem.removesuffix("-values") for path in (CHART_DIR / "ci").glob("*.yaml"))


def case_values(case: str) -> dict[str, Any]:
    text = (CHART_DIR / "ci" / f"{case}-values.yaml").read_text()
    return yaml.safe_load(text) or {}


def release_name(case: str) -> str:
    return LONG_RELEASE if case == "long-names" else RELEASE


@functools.cache
def _chart() -> Any:
    import helm_python

    helm_python.disable_logging()
    return helm_python.Chart.load(CHART_DIR)


def render(values: dict[str, Any], release: str = RELEASE) -> dict[str, str]:
    """Template path -> rendered text (NOTES.txt included); raises Helm's error."""
    return dict(_chart().render(values=values, name=release, namespace=NAMESPACE, is_install=True))


def manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every object the release would create, sorted by kind and name."""
    docs = [
        doc
        for path, text in rendered.items()
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]
    return sorted(docs, key=lambda d: (d["kind"], d["metadata"]["name"]))


def render_case(case: str) -> tuple[dict[str, str], list[dict[str, Any]]]:
    rendered = render(case_values(case), release_name(case))
    return rendered, manifests(rendered)


def merged_values(case: str) -> dict[str, Any]:
    """The chart's defaults with the case's values over them (what the templates see)."""
    return dict(_chart().merge_values(case_values(case)))


def validate_values(values: dict[str, Any]) -> None:
    """Validate against values.schema.json (as `helm install` does); raises HelmValuesError."""
    _chart().validate_schema(_chart().merge_values(values))


def lint(values: dict[str, Any], kube_version: str) -> list[dict[str, Any]]:
    """`helm lint --strict` findings (severity 1 info, 2 warning, 3 error)."""
    import helm_python

    report = helm_python.lint(CHART_DIR, values, strict=True, kube_version=kube_version)
    return list(report["messages"])
