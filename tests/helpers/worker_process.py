"""One real worker in its own process, so a test can `kill -9` it.

Run as `python -m tests.helpers.worker_process ROLE WORKER_ID MODEL_DIR`: it starts the
worker (tiny engine settings, as the in-process cluster's), prints `ENDPOINT host:port`
on stdout, and serves until killed or until stdin closes (so a test that dies leaves no
orphan). `WorkerProcess` is the test side.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from tandem.worker.config import WorkerRole

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120.0


class WorkerProcess:
    """A worker process the test owns: `start()` waits for its endpoint; `kill()` is -9."""

    def __init__(self, role: WorkerRole, worker_id: str, model_dir: str) -> None:
        self.role = WorkerRole(role)
        self.worker_id = worker_id
        self.model_dir = model_dir
        self.endpoint = ""
        self._proc: subprocess.Popen | None = None

    def start(self) -> WorkerProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.helpers.worker_process",
                self.role.value,
                self.worker_id,
                self.model_dir,
            ],
            cwd=REPO_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> str:
        """Block until the worker printed its endpoint (it is then serving)."""
        assert self._proc is not None and self._proc.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(self._proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while not self.endpoint:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._proc.poll() is not None:
                self.kill()
                raise AssertionError(f"worker {self.worker_id} did not start")
            if selector.select(timeout=remaining):
                line = self._proc.stdout.readline()
                if line.startswith("ENDPOINT "):
                    self.endpoint = line.split()[1]
        selector.close()
        return self.endpoint

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else 0

    def kill(self) -> None:
        """SIGKILL, as a crash or an OOM kill: nothing is cleaned up by the worker."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.wait(10)

    def stop(self) -> None:
        """Close stdin (the worker stops itself), then kill if it lingers."""
        if self._proc is None or self._proc.poll() is not None:
            return
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            self._proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()


async def _serve(role: WorkerRole, worker_id: str, model_dir: str) -> None:
    from tandem.decode_worker.server import DecodeWorker
    from tandem.engine.config import EngineConfig
    from tandem.prefill_worker.server import PrefillWorker
    from tandem.worker.config import WorkerConfig
    from tests.helpers.kv_budget import TEST_KV_CACHE_BYTES

    engine = EngineConfig(
        model=model_dir,
        mode=role.engine_mode,
        num_threads=1,
        max_model_len=1024,
        kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
    )
    config = WorkerConfig(worker_id=worker_id, role=role, engine=engine)
    cls = PrefillWorker if role is WorkerRole.PREFILL else DecodeWorker
    server = cls(config)
    endpoint = await server.start()
    print(f"ENDPOINT {endpoint}", flush=True)
    loop = asyncio.get_running_loop()
    # Serve until the test closes our stdin (or kills us).
    await loop.run_in_executor(None, sys.stdin.read)
    await server.stop()


if __name__ == "__main__":
    asyncio.run(_serve(WorkerRole(sys.argv[1]), sys.argv[2], sys.argv[3]))
