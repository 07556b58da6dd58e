"""Settings of one worker process (prefill, decode or colocated) around its engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tandem.engine.config import EngineConfig, EngineMode


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


@dataclass
class WorkerConfig:
    """Built once by the cluster launcher (or a test) and passed to the worker."""

    worker_id: str
    role: WorkerRole
    engine: EngineConfig
    # Address the worker's gRPC server binds; port 0 picks a free port.
    host: str = "127.0.0.1"
    port: int = 0
    # Port of the worker's Prometheus /metrics HTTP endpoint; 0 picks a free port.
    metrics_port: int = 0
    # KV transfer backend: "tcp" (CPU), "nccl" (GPU) or "local" (same process).
    kv_backend: str = "tcp"
    # Longest a decode worker waits for free blocks before refusing a request.
    admission_timeout_s: float = 30.0
    # Longest one KV pull may take before the decode worker recomputes locally.
    pull_timeout_s: float = 30.0
    # Longest a graceful stop waits for in-flight requests.
    drain_timeout_s: float = 10.0
    # OpenTelemetry trace exporter: "none", "console" or "otlp".
    trace_exporter: str = "none"

    def __post_init__(self) -> None:
        self.role = WorkerRole(self.role)
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if self.kv_backend not in ("tcp", "nccl", "local"):
            raise ValueError(f"kv_backend must be tcp, nccl or local, got {self.kv_backend!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("admission_timeout_s", "pull_timeout_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.engine.mode is not self.role.engine_mode:
            raise ValueError(
                f"a {self.role.value} worker needs engine mode {self.role.engine_mode.value}, "
                f"got {self.engine.mode.value}"
            )
