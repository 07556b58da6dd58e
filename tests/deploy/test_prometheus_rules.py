"""deploy/prometheus/rules.yaml: valid for Prometheus (`promtool check rules`) and its
alerts behave as rules_test.yaml says (`promtool test rules`). promtool comes from
Debian's `prometheus` package (.ci/run installs it); without it these tests skip."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers.helm_chart import ROOT

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        shutil.which("promtool") is None,
        reason="promtool not installed (Debian package `prometheus`; .ci/run installs it)",
    ),
]

RULES_DIR = ROOT / "deploy" / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=30,
        check=False,
    )  # fmt: skip


def test_rules_are_valid():
    result = promtool("check", "rules", "rules.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rule_unit_tests_pass():
    result = promtool("test", "rules", "rules_test.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
