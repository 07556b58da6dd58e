"""The servers an experiment measures, each a real server process of its own.

A `ServerSpec` names a system (`tandem serve` in some layout, or `transformers serve`)
and the command line that starts it; `running(specs)` starts them all, waits until each
answers, yields their endpoints, and stops them (SIGINT, then SIGTERM, then SIGKILL of
the whole process group) on exit, error or Ctrl-C. Each server's output goes to a log
file next to the results, so a failed start can be read afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

# Per-process wait for a server to start (Ray + workers + router, or a model load).
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ServerSpec:
    """One system under test."""

    # Short name used in results and plots ("tandem 1P+1D", "transformers serve").
    label: str
    # The command line; ports are filled in by `ports`.
    argv: tuple[str, ...]
    # OpenAI-compatible base URL ("http://127.0.0.1:PORT").
    http_url: str
    # Tandem's gRPC target ("grpc://127.0.0.1:PORT"); None for other servers.
    grpc_target: str | None = None
    # Environment added to this process's.
    env: dict[str, str] = field(default_factory=dict)

    @property
    def slug(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.label.lower()).strip("-")


def tandem_spec(
    label: str,
    model_dir: str,
    grpc_port: int,
    http_port: int,
    layout: Sequence[str],
    max_model_len: int,
) -> ServerSpec:
    """`tandem serve` with `layout` flags (e.g. `--prefill 1 --decode 1`)."""
    argv = (
        sys.executable,
        "-m",
        "tandem.cluster.cli",
        "serve",
        "--model",
        model_dir,
        "--grpc-port",
        str(grpc_port),
        "--http-port",
        str(http_port),
        "--max-model-len",
        str(max_model_len),
        *layout,
    )
    return ServerSpec(
        label,
        argv,
        http_url=f"http://127.0.0.1:{http_port}",
        grpc_target=f"grpc://127.0.0.1:{grpc_port}",
    )


def transformers_spec(
    model_dir: str, http_port: int, kv_blocks: int, kv_block_size: int = 16
) -> ServerSpec:
    """`transformers serve --continuous-batching` on the CPU, pinned to `model_dir`, with
    a KV cache of `kv_blocks` blocks (left to itself it sizes the cache from free memory,
    which on a CPU is most of the machine's RAM)."""
    executable = Path(sys.executable).with_name("transformers")
    argv = (
        str(executable),
        "serve",
        "--continuous-batching",
        "--cb-block-size",
        str(kv_block_size),
        "--cb-num-blocks",
        str(kv_blocks),
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        str(http_port),
        model_dir,
    )
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return ServerSpec("transformers serve", argv, f"http://127.0.0.1:{http_port}", env=offline)


class ServerProcess:
    """One started server; `stop()` ends its whole process group."""

    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("wb")
        logger.info("starting %s: %s", spec.label, " ".join(spec.argv))
        self._proc = subprocess.Popen(
            spec.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **spec.env},
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until `GET /v1/models` answers 200; raises when the process dies or time is up."""
        deadline = time.monotonic() + timeout_s
        url = f"{self.spec.http_url}/v1/models"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"{self.spec.label} exited with {self._proc.returncode}; see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(url, timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.spec.label} not ready in {timeout_s:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGINT, STOP_TIMEOUT_S), (signal.SIGTERM, 10.0)):
            if self._proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(wait_s)
        # The leader may be gone while Ray's children linger: end the group either way.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()
        self._log.close()


@contextlib.contextmanager
def running(specs: Sequence[ServerSpec], log_dir: Path) -> Iterator[list[ServerSpec]]:
    """Start every server (one after another, so start-ups do not compete), wait until
    each is ready, yield them, and stop them all on the way out."""
    started: list[ServerProcess] = []
    try:
        for spec in specs:
            server = ServerProcess(spec, log_dir / f"{spec.slug}.log")
            started.append(server)
            server.wait_ready()
            logger.info("%s ready", spec.label)
        yield list(specs)
    finally:
        for server in reversed(started):
            server.stop()
