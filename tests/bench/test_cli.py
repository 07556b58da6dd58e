"""`tandem-bench`: every suite is reachable and parses its own arguments."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.bench.cli import SUITES, main

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_every_suite_answers_help(suite, capsys):
    with pytest.raises(SystemExit) as done:
        main([suite, "--help"])
    assert done.value.code == 0
    assert f"usage: tandem-bench {suite}" in capsys.readouterr().out


def test_no_suite_prints_the_overview_and_an_unknown_one_fails(capsys):
    assert main([]) == 0
    assert "tandem-bench experiment" in capsys.readouterr().out
    assert main(["nope"]) == 2
    assert "unknown suite 'nope'" in capsys.readouterr().err


def test_a_suite_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as done:
        main(["router", "--concurrency", "many"])
    assert done.value.code == 2
    assert "invalid int value" in capsys.readouterr().err


def test_the_product_cli_has_no_bench_command():
    """The product does not depend on the bench tool: `tandem bench` is gone."""
    reply = subprocess.run(
        [sys.executable, "-m", "tandem.cluster.cli", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert reply.returncode == 2 and "invalid choice: 'bench'" in reply.stderr
