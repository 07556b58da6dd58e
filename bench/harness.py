"""The process harness: every server a benchmark measures is a real process of its own."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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
# `tandem serve` announces each worker as "  ROLE  WORKER_ID  HOST:PORT".
_WORKER_LINE = re.compile(r"^\s+(prefill|decode|colocated)\s+(\S+)\s+(\S+:\d+)\s*$", re.M)


@dataclass(frozen=True)
class ServerSpec:
    """One system under test."""

    label: str  # short name used in results and plots ("tandem 1P+1D", "transformers serve")
    argv: tuple[str, ...]
    # Polled until it answers: "http://HOST:PORT/PATH" (200) or "tcp://HOST:PORT" (accepts).
    ready: str
    http_url: str = ""  # OpenAI-compatible base URL ("http://127.0.0.1:PORT"); "" when it has none
    # Tandem's gRPC target ("grpc://127.0.0.1:PORT"); None for other servers.
    grpc_target: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # environment added to this process's
    cores: tuple[int, ...] = ()  # cores the process is pinned to (empty: not pinned)

    @property
    def slug(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.label.lower()).strip("-")


def tandem_spec(
    label: str, model_dir: str, grpc_port: int, http_port: int, flags: Sequence[str] = ()
) -> ServerSpec:
    """`tandem serve` on these ports with more `flags` (e.g. `--prefill 1 --decode 1`)."""
    argv: tuple[str, ...] = (sys.executable, "-m", "tandem.cluster.cli", "serve")
    argv += ("--model", model_dir)
    argv += ("--grpc-port", str(grpc_port), "--http-port", str(http_port), *flags)
    http_url = f"http://127.0.0.1:{http_port}"
    # Unbuffered: the worker endpoints it prints must reach the log at once.
    env = {"PYTHONUNBUFFERED": "1"}
    return ServerSpec(
        label, argv, f"{http_url}/v1/models", http_url, f"grpc://127.0.0.1:{grpc_port}", env
    )


def cpu_pair_spec(label: str, model_dir: Path, flags: Sequence[str] = ()) -> ServerSpec:
    """`tandem serve` with one prefill and one decode worker on the CPU, KV over TCP (the
    router benchmarks' cluster), on free ports."""
    pair = ("--prefill", "1", "--decode", "1", "--device", "cpu", "--kv-backend", "tcp")
    flags = (*pair, "--max-model-len", "1024", *flags)
    return tandem_spec(label, str(model_dir), free_port(), free_port(), flags)


def transformers_spec(
    model_dir: str, http_port: int, kv_blocks: int, kv_block_size: int = 16
) -> ServerSpec:
    """`transformers serve --continuous-batching` on the CPU, pinned to `model_dir`, with
    a KV cache of `kv_blocks` blocks (left to itself it sizes the cache from free memory,
    which on a CPU is most of the machine's RAM)."""
    executable = str(Path(sys.executable).with_name("transformers"))
    argv: tuple[str, ...] = (executable, "serve", "--continuous-batching")
    argv += ("--cb-block-size", str(kv_block_size))
    argv += ("--cb-num-blocks", str(kv_blocks), "--device", "cpu", "--host", "127.0.0.1")
    argv += ("--port", str(http_port), model_dir)
    http_url = f"http://127.0.0.1:{http_port}"
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return ServerSpec("transformers serve", argv, f"{http_url}/v1/models", http_url, env=offline)


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(ready: str) -> bool:
    try:
        if ready.startswith("tcp://"):
            host, port = ready.removeprefix("tcp://").rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=5):
                return True
        with urllib.request.urlopen(ready, timeout=5) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class ServerProcess:
    """One started server; `stop()` ends its whole process group."""

    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("wb")
        argv = spec.argv
        if spec.cores:
            if shutil.which("taskset"):
                argv = ("taskset", "-c", ",".join(map(str, spec.cores)), *argv)
            else:
                logger.warning("no taskset: %s runs unpinned", spec.label)
        logger.info("starting %s: %s", spec.label, " ".join(argv))
        self._proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **spec.env},
            start_new_session=True,
            # A shell's background job inherits SIGINT ignored; `stop()` relies on it.
            preexec_fn=_default_sigint,
        )

    @property
    def pid(self) -> int:
        return self._proc.pid

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until `spec.ready` answers; raises when the process dies or time is up."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"{self.spec.label} exited with {self._proc.returncode}; see {self.log_path}"
                )
            if _answers(self.spec.ready):
                return
            time.sleep(1.0)
        raise TimeoutError(f"{self.spec.label} not ready in {timeout_s:.0f}s; see {self.log_path}")

    def worker_endpoints(self, timeout_s: float = 30.0) -> dict[str, str]:
        """role -> gRPC endpoint of the workers `tandem serve` announced (first per role)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found: dict[str, str] = {}
            for role, _, endpoint in _WORKER_LINE.findall(
                self.log_path.read_text("utf-8", "replace")
            ):
                found.setdefault(role, endpoint)
            if found or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if not found:
            raise RuntimeError(f"{self.spec.label} announced no workers; see {self.log_path}")
        return found

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
        try:
            self._proc.wait(10.0)
        except subprocess.TimeoutExpired:
            logger.warning("%s (pid %d) outlived SIGKILL by 10 s", self.spec.label, self.pid)
        finally:
            self._log.close()


@contextlib.contextmanager
def running(specs: Sequence[ServerSpec], log_dir: Path) -> Iterator[list[ServerProcess]]:
    """Start every server (one after another, so start-ups do not compete), wait until
    each is ready, yield them, and stop them all on the way out."""
    started: list[ServerProcess] = []
    try:
        for spec in specs:
            server = ServerProcess(spec, log_dir / f"{spec.slug}.log")
            started.append(server)
            server.wait_ready()
            logger.info("%s ready", spec.label)
        yield started
    finally:
        for server in reversed(started):
            server.stop()


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default action."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into `SystemExit`, so `running` stops the servers when a benchmark
    is killed."""

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat after the ")" that closes the command name (state is field 1)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (all its threads), None if unreadable."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    # utime and stime are fields 12 and 13 (counted from the state).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def session_pids(session_id: int) -> list[int]:
    """Every live process of session `session_id` (a server started in a session of its
    own leads it; Ray's daemons and workers stay in it)."""
    pids = []
    for entry in os.listdir("/proc"):
        fields = _stat_fields(entry) if entry.isdigit() else None
        if fields is not None and int(fields[3]) == session_id:  # field 3: session id
            pids.append(int(entry))
    return pids


def session_cpu_s(session_id: int) -> float:
    """CPU seconds of every live process of session `session_id` (see `session_pids`)."""
    return sum(process_cpu_s(pid) or 0.0 for pid in session_pids(session_id))


def ensure_model(model_dir: Path, preset: str) -> Path:
    """The model directory, made from `preset` (seed 0) when absent; made in a temporary
    directory next to it and renamed, so a concurrent maker never sees half a model."""
    if (model_dir / "config.json").is_file():
        return model_dir
    from tandem.engine.model_maker import make_model

    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-", dir=model_dir.parent))
    try:
        make_model(preset, tmp / "model", seed=0)
        try:
            (tmp / "model").rename(model_dir)
        except OSError:
            if not (model_dir / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model_dir
