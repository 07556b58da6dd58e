"""Settings of one worker process (prefill, decode or colocated) around its engine.

`WorkerSettings` are what every worker of a cluster shares (built once from the CLI);
`WorkerConfig` adds one process's identity (id, role, ports) and its `EngineConfig`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tandem.engine.config import EngineConfig, EngineMode, parse_enum
from tandem.proto.cluster_auth import ClusterAuth
from tandem.telemetry.tracing import DEFAULT_TRACE_EXPORTER, TraceExporter
from tandem.worker.engine_loop import DEFAULT_STEP_WATCHDOG_S


class WorkerRole(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    # A decode worker that prefills everything itself (the baseline deployment).
    COLOCATED = "colocated"

    @property
    def engine_mode(self) -> EngineMode:
        return {
            WorkerRole.PREFILL: EngineMode.PREFILL_ONLY,
            WorkerRole.DECODE: EngineMode.DECODE_ONLY,
            WorkerRole.COLOCATED: EngineMode.COLOCATED,
        }[self]


class KvBackend(enum.StrEnum):
    """How a decode worker pulls KV from a prefill worker."""

    # Per worker pair, settled when a channel opens (`kv_transfer.cuda_ipc`): cuda_ipc
    # on one node (two processes), nccl between nodes, tcp with a CPU engine.
    AUTO = "auto"
    # Raw bytes over a socket (CPU, or GPU through host memory).
    TCP = "tcp"
    # ncclSend/ncclRecv between GPUs (not two workers on one GPU: NCCL refuses that).
    NCCL = "nccl"
    # Device-to-device copies out of the prefill worker's cache, mapped by CUDA IPC
    # (workers on one node, in different processes).
    CUDA_IPC = "cuda_ipc"
    # Engines in one process (`kv_transfer.local`, tests and benchmarks); no worker
    # server can use it (WorkerSettings refuses it).
    LOCAL = "local"


DEFAULT_HOST = "127.0.0.1"


def default_kv_backend(device: str) -> KvBackend:
    """AUTO (chosen per worker pair) between GPUs, TCP otherwise."""
    return KvBackend.AUTO if device.startswith("cuda") else KvBackend.TCP


def resolve_kv_backend(backend: KvBackend | None, device: str) -> KvBackend:
    """The backend a worker's KV client asks for: None and AUTO are TCP on a CPU engine."""
    if backend is None or (backend is KvBackend.AUTO and not device.startswith("cuda")):
        return default_kv_backend(device)
    return backend


def check_kv_backend(backend: KvBackend | None, device: str) -> None:
    """ValueError when `backend` cannot move KV between engines on `device` (pair-level
    impossibilities, such as nccl on one GPU, are refused when a channel opens)."""
    gpu_only = (KvBackend.NCCL, KvBackend.CUDA_IPC)
    if backend in gpu_only and not device.startswith("cuda"):
        raise ValueError(
            f"kv_backend {backend} needs GPU engines; the engines run on {device} (use tcp)"
        )


@dataclass
class WorkerSettings:
    """What every worker of a cluster shares; validated on construction."""

    # Address the worker's gRPC and metrics servers bind.
    host: str = DEFAULT_HOST
    # None = by the engines' device (see `default_kv_backend`).
    kv_backend: KvBackend | None = None
    # Longest a decode worker waits for free blocks before refusing a request.
    admission_timeout_s: float = 30.0
    # Longest one KV pull may take before the decode worker recomputes locally.
    pull_timeout_s: float = 30.0
    # Longest a graceful stop waits for in-flight requests.
    drain_timeout_s: float = 10.0
    # Longest one engine step may run before the worker's health probe fails (a hung
    # kernel); a long prefill chunk of a big model on a CPU is healthy up to it.
    step_watchdog_s: float = DEFAULT_STEP_WATCHDOG_S
    trace_exporter: TraceExporter = DEFAULT_TRACE_EXPORTER
    # Cluster token (and optional TLS) that internal gRPC calls and KV data connections
    # to this worker must carry, and that it presents to other workers; the default
    # leaves them open (in-process tests). `tandem serve` always sets a token.
    cluster_auth: ClusterAuth = field(default_factory=ClusterAuth)

    def __post_init__(self) -> None:
        if not isinstance(self.cluster_auth, ClusterAuth):
            raise ValueError(f"cluster_auth must be a ClusterAuth, got {self.cluster_auth!r}")
        if self.kv_backend is not None:
            self.kv_backend = parse_enum(KvBackend, self.kv_backend, "kv_backend")
        if self.kv_backend is KvBackend.LOCAL:
            raise ValueError(
                "kv_backend local moves KV between engines inside one process; worker "
                "servers pull from each other over tcp, nccl or cuda_ipc"
            )
        self.trace_exporter = parse_enum(TraceExporter, self.trace_exporter, "trace_exporter")
        if not self.host:
            raise ValueError("host must not be empty")
        for name in ("admission_timeout_s", "pull_timeout_s", "drain_timeout_s", "step_watchdog_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class WorkerConfig:
    """Built once by the cluster launcher (or a test) and passed to the worker."""

    worker_id: str
    role: WorkerRole
    engine: EngineConfig
    settings: WorkerSettings = field(default_factory=WorkerSettings)
    # Port of the worker's gRPC server; 0 picks a free port.
    port: int = 0
    # Port of the worker's Prometheus /metrics HTTP endpoint; 0 picks a free port.
    metrics_port: int = 0

    def __post_init__(self) -> None:
        self.role = parse_enum(WorkerRole, self.role, "role")
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        check_kv_backend(self.settings.kv_backend, self.engine.device)
        if self.engine.mode is not self.role.engine_mode:
            raise ValueError(
                f"engine.mode: a {self.role.value} worker needs engine mode "
                f"{self.role.engine_mode.value}, got {self.engine.mode.value}"
            )

    # The shared settings, read where the worker used to hold them itself.
    @property
    def host(self) -> str:
        return self.settings.host

    @property
    def kv_backend(self) -> KvBackend:
        return resolve_kv_backend(self.settings.kv_backend, self.engine.device)

    @property
    def admission_timeout_s(self) -> float:
        return self.settings.admission_timeout_s

    @property
    def pull_timeout_s(self) -> float:
        return self.settings.pull_timeout_s

    @property
    def drain_timeout_s(self) -> float:
        return self.settings.drain_timeout_s

    @property
    def step_watchdog_s(self) -> float:
        return self.settings.step_watchdog_s

    @property
    def trace_exporter(self) -> TraceExporter:
        return self.settings.trace_exporter

    @property
    def cluster_auth(self) -> ClusterAuth:
        return self.settings.cluster_auth
