"""`tandem serve --ray-address` joining a Ray cluster started with `ray start --head`, as
an operator starts one by hand. Such a cluster has Ray's token auth on by default (the
token in ~/.ray/auth_token); `tandem serve` sends it, as `tandem router` and `tandem
pools` do (without it: "Failed to connect to Ray cluster", and a traceback)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.bench.harness import free_port, session_pids
from tests.helpers.grpc_calls import generate_tokens
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.parallel import DISRUPTS_ITS_CLUSTER
from tests.helpers.prompts import make_prompts
from tests.helpers.tandem_command import TandemCommand

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, DISRUPTS_ITS_CLUSTER]

MAX_TOKENS = 8


class RayHead:
    """`ray start --head --block` in a session of its own (ended whole by `stop`)."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        argv = [
            str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
            f"--port={self.port}", f"--ray-client-server-port={free_port()}",
            "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
        ]  # fmt: skip
        env = {key: value for key, value in os.environ.items() if key != "RAY_AUTH_MODE"}
        with log_path.open("w") as log:
            self._proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in self.log_path.read_text("utf-8", "replace"):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"ray start failed:\n{self.log_path.read_text()}")
            time.sleep(0.2)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM to its session, SIGKILL past `timeout_s` (`ray start --block` may
        not exit on SIGTERM); returns once the session is empty (AssertionError if not)."""
        deadline = time.monotonic() + timeout_s
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, sig)
            while time.monotonic() < deadline:
                self._proc.poll()  # reaps `ray start` once it exits
                if not session_pids(self._proc.pid):
                    return
                time.sleep(0.2)
            deadline = time.monotonic() + 10.0
        raise AssertionError(f"Ray's processes outlived SIGKILL: {session_pids(self._proc.pid)}")


def test_serve_joins_a_ray_start_head_cluster(tiny_model_dir, tmp_path):
    prompts = make_prompts(2048, (12, 30), seed=33)
    expected = hf_greedy(tiny_model_dir, prompts, MAX_TOKENS)
    head = RayHead(tmp_path / "ray.log")
    serve = None
    try:
        head.wait_ready()
        assert "Token authentication is enabled" in head.log_path.read_text()
        serve = TandemCommand(
            "serve", tmp_path / "serve.log", "--ray-address", head.address,
            "--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32",
            "--threads", "1", "--planner", "off",
        )  # fmt: skip
        serve.wait_ready(180)
        got = asyncio.run(generate_tokens(serve.grpc_endpoint, prompts, MAX_TOKENS))
        assert got == expected
        assert serve.stop(120.0, signal.SIGTERM) == 0, serve.output[-3000:]
        assert serve.session_pids() == []
    finally:
        if serve is not None:
            serve.stop()
            serve.kill_session()
        head.stop()
