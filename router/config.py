"""Router settings, built once by `tandem serve` (or a test) and passed down.

The router configures nothing the workers already know: KV block size and the longest
prompt + output come from their `Stats` answers at start (see `PolicyRuntime`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tandem.engine.config import parse_enum
from tandem.proto.cluster_auth import ClusterAuth
from tandem.router.openai.sampling_fields import DEFAULT_MAX_N
from tandem.router.policy import (
    DEFAULT_ADMISSION_POLICY,
    DEFAULT_MAX_LOCAL_PREFILL_TOKENS,
    AdmissionPolicy,
)
from tandem.router.sampling_defaults import GenerationConfigUse
from tandem.telemetry.tracing import DEFAULT_TRACE_EXPORTER, TraceExporter
from tandem.worker.config import DEFAULT_HOST

DEFAULT_GRPC_PORT = 50051
DEFAULT_HTTP_PORT = 8000


@dataclass
class RouterConfig:
    # Model directory (tokenizer, config) the workers serve.
    model_dir: str
    # Name clients use in `model`; default: the directory's name.
    model_name: str = ""
    host: str = DEFAULT_HOST
    # Public gRPC (tandem.v1.Generation) and HTTP ports; 0 picks a free port.
    grpc_port: int = DEFAULT_GRPC_PORT
    http_port: int = DEFAULT_HTTP_PORT
    # Longest a prefill call may take (queueing included).
    prefill_timeout_s: float = 300.0
    # Longest a whole request may stream.
    request_timeout_s: float = 1800.0
    # Longest a worker may take to answer a health or stats probe.
    probe_timeout_s: float = 5.0
    trace_exporter: TraceExporter = DEFAULT_TRACE_EXPORTER
    # SLO admission (see `AdmissionPolicy`).
    admission_policy: AdmissionPolicy = DEFAULT_ADMISSION_POLICY
    # SLO class of requests that name none, and overrides of the interactive targets.
    slo_class: str = "interactive"
    ttft_slo_s: float | None = None
    itl_slo_s: float | None = None
    # Seed the latency models from timed probe requests at start (a few seconds).
    warmup_profile: bool = True
    # How often the router polls every worker's Stats for the policy's live view.
    stats_interval_s: float = 0.25
    # Conditional disaggregation: the longest uncached prompt a decode worker may
    # prefill itself when that predicts better goodput; 0 = always use prefill workers.
    max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL_TOKENS
    # Every public API (HTTP, and each gRPC service) needs `Authorization: Bearer
    # <api_key>` (router/api_key.py); None: open. Health, `/metrics` and gRPC reflection
    # stay open either way.
    api_key: str | None = None
    # Largest HTTP request body (bigger: 413) and public gRPC message (bigger:
    # RESOURCE_EXHAUSTED) accepted.
    max_body_bytes: int = 8 * 1024 * 1024
    # Cluster token (and optional TLS) the router presents on its calls to workers: the
    # workers' `WorkerSettings.cluster_auth`. (The public APIs use `api_key`.)
    cluster_auth: ClusterAuth = field(default_factory=ClusterAuth)
    # Times one request may move to another worker after its worker failed (0: never);
    # past them the client gets one retriable UNAVAILABLE / 503.
    max_migrations: int = 3
    # Longest a migrating request that has streamed tokens waits for a decode worker to
    # move to when none is available (its only one died; a replacement loads its model
    # first: seconds on CPU, longer for big models); past it the client gets 503.
    migration_wait_s: float = 60.0
    # Most choices (`n`) one OpenAI request may ask for (each decodes on its own).
    max_n: int = DEFAULT_MAX_N
    # Whether the model's generation_config.json sets the sampling defaults of requests
    # that leave them out (router/sampling_defaults.py), as vLLM's default does.
    generation_config: GenerationConfigUse = GenerationConfigUse.AUTO

    def __post_init__(self) -> None:
        if not isinstance(self.cluster_auth, ClusterAuth):
            raise ValueError(f"cluster_auth must be a ClusterAuth, got {self.cluster_auth!r}")
        self.admission_policy = parse_enum(
            AdmissionPolicy, self.admission_policy, "admission_policy"
        )
        self.trace_exporter = parse_enum(TraceExporter, self.trace_exporter, "trace_exporter")
        self.generation_config = parse_enum(
            GenerationConfigUse, self.generation_config, "generation_config"
        )
        for name in ("ttft_slo_s", "itl_slo_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        if self.max_local_prefill_tokens < 0:
            raise ValueError(
                f"max_local_prefill_tokens must be >= 0, got {self.max_local_prefill_tokens}"
            )
        if self.stats_interval_s <= 0:
            raise ValueError(f"stats_interval_s must be > 0, got {self.stats_interval_s}")
        if not Path(self.model_dir, "config.json").is_file():
            raise ValueError(f"model_dir {self.model_dir!r} has no config.json")
        if not self.model_name:
            self.model_name = Path(self.model_dir).resolve().name
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        for name in ("prefill_timeout_s", "request_timeout_s", "probe_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.api_key is not None and (
            not isinstance(self.api_key, str) or not self.api_key.strip()
        ):
            raise ValueError("api_key must be a non-blank string or None")
        if self.grpc_port == self.http_port != 0:
            raise ValueError(
                f"grpc_port and http_port must differ (0: a free one each), both {self.http_port}"
            )
        if isinstance(self.max_migrations, bool) or not isinstance(self.max_migrations, int) \
                or self.max_migrations < 0:  # fmt: skip
            raise ValueError(f"max_migrations must be an integer >= 0, got {self.max_migrations!r}")
        if not 0 <= self.migration_wait_s <= self.request_timeout_s:
            raise ValueError(
                f"migration_wait_s must be in [0, request_timeout_s], got {self.migration_wait_s}"
            )
        if isinstance(self.max_n, bool) or not isinstance(self.max_n, int) or self.max_n < 1:
            raise ValueError(f"max_n must be an integer >= 1, got {self.max_n!r}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
