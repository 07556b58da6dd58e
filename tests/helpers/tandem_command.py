"""`tandem router --ray-address ADDR` (what a Kubernetes router Deployment runs) or
`tandem serve` as a process of its own, leading a session of its own (so what it starts,
Ray's daemons included, can be found and ended): started on free ports, its endpoints
read from what it announces (its output goes to a file, so a chatty log never blocks it
on a full pipe), stopped with a signal (Ctrl-C's SIGINT unless told) and killed, with
its whole session, if that does not end it in time."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tandem.bench.harness import session_pids
from tests.helpers.worker_process import REPO_ROOT

# What `tandem router` and `tandem serve` print once they serve.
_GRPC_LINE = re.compile(r"gRPC\s+tandem\.v1\.Generation\s+(\S+:\d+)")
_HTTP_LINE = re.compile(r"HTTP\s+(http://\S+:\d+)/health")


class TandemCommand:
    """`tandem COMMAND ARGS` on free ports; see the module doc."""

    def __init__(self, command: str, log_path: Path, *args: str) -> None:
        argv = [sys.executable, "-m", "tandem.cluster.cli", command,
                "--grpc-port", "0", "--http-port", "0", *args]  # fmt: skip
        self.command = command
        self.grpc_endpoint = ""
        self.http_endpoint = ""
        self.log_path = log_path
        # The child keeps its own descriptor of the log; this one closes at once.
        with log_path.open("w") as log:
            self._proc = subprocess.Popen(
                argv,
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def output(self) -> str:
        return self.log_path.read_text("utf-8", "replace")

    def wait_ready(self, timeout_s: float = 120.0) -> TandemCommand:
        """Until both endpoints are announced; AssertionError (with its output) when the
        process exits first or time is up."""
        deadline = time.monotonic() + timeout_s
        while True:
            output = self.output
            grpc_line, http_line = _GRPC_LINE.search(output), _HTTP_LINE.search(output)
            if grpc_line and http_line:
                self.grpc_endpoint, self.http_endpoint = grpc_line[1], http_line[1]
                return self
            if self._proc.poll() is not None:
                raise AssertionError(
                    f"tandem {self.command} exited with {self._proc.returncode}:\n{output}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"tandem {self.command} not ready in {timeout_s:g} s:\n{output}"
                )
            time.sleep(0.2)

    def stop(self, timeout_s: float = 60.0, sig: signal.Signals = signal.SIGINT) -> int:
        """`sig` to the command alone (as Kubernetes or a terminal sends it), then its exit
        status (its session SIGKILLed, and -9, past `timeout_s`)."""
        if self._proc.poll() is None:
            self._proc.send_signal(sig)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                # Its threads' stacks into its log first (`tandem` dumps them on SIGUSR1).
                self._proc.send_signal(signal.SIGUSR1)
                time.sleep(1.0)
                self.kill_session()
                self._proc.wait(10)
        return self._proc.returncode

    def session_pids(self) -> list[int]:
        """Its live processes (the command's own while it runs, and whatever it started)."""
        return session_pids(self._proc.pid)

    def kill_session(self) -> None:
        """SIGKILL to every process of its session (what a failed stop left behind)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)


class RouterCommand(TandemCommand):
    def __init__(self, ray_address: str, log_path: Path, *flags: str) -> None:
        super().__init__("router", log_path, "--ray-address", ray_address, *flags)
