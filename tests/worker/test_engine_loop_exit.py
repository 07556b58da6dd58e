"""A process that exits while its engine thread is mid-step (a Ray worker sent SIGTERM)
exits cleanly: the thread is stopped before the interpreter finalizes. Before, the
thread was unwound through torch's native frames and the process aborted ("terminate
called without an active exception"), in every busy worker sent SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.helpers.worker_process import REPO_ROOT

pytestmark = pytest.mark.timeout(180)


def test_sigterm_while_the_engine_steps_exits_cleanly(tiny_model_dir):
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.busy_engine_process", str(tiny_model_dir)],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,  # held open: the child exits when it closes
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "BUSY"
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)  # not communicate(): closing stdin also ends the child
        assert process.stderr is not None
        stderr = process.stderr.read()
    finally:
        process.kill()
        process.wait(timeout=30)
    assert process.returncode == 1, stderr  # the handler's SystemExit(1), not SIGABRT (-6)
    for sign in ("terminate called", "Fatal Python error", "Traceback"):
        assert sign not in stderr, stderr
