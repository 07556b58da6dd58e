"""`tandem serve` flags -> the typed cluster tree, and flags the CLI refuses (no cluster
is started: `main` exits at argument checking, before Ray)."""

from __future__ import annotations

import pytest
import torch

from tandem.cluster.cli import build_parser, cluster_config_from_args, main
from tandem.cluster.config import ClusterConfig, PoolsConfig, RayConfig
from tandem.engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from tandem.router.config import RouterConfig
from tandem.router.policy import AdmissionPolicy
from tandem.telemetry.tracing import TraceExporter
from tandem.worker.config import KvBackend, WorkerRole, WorkerSettings


def config_of(model_dir, *flags: str) -> ClusterConfig:
    args = build_parser().parse_args(["serve", "--model", str(model_dir), *flags])
    return cluster_config_from_args(args)


def refused(capsys, model_dir, *flags: str) -> str:
    """Run `tandem serve` with `flags`: it must exit 2 before starting anything; its stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", str(model_dir), *flags])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_defaults_come_from_the_config_classes(tiny_model_dir):
    config = config_of(tiny_model_dir, "--device", "cpu")
    assert config.pools == PoolsConfig()
    assert config.roles == [WorkerRole.PREFILL, WorkerRole.DECODE]
    assert config.engine.enable_chunked_prefill
    assert config.engine.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert config.engine.block_size == EngineConfig.__dataclass_fields__["block_size"].default
    defaults = RouterConfig(model_dir=str(tiny_model_dir))
    assert config.router.admission_policy is defaults.admission_policy is AdmissionPolicy.NONE
    assert config.router.max_local_prefill_tokens == defaults.max_local_prefill_tokens
    assert (config.router.grpc_port, config.router.http_port) == (
        defaults.grpc_port,
        defaults.http_port,
    )
    # Every setting at its default but the cluster token, which serve always sets
    # (tests/cluster/test_security_flags.py covers where it comes from).
    assert config.worker == WorkerSettings(cluster_auth=config.worker.cluster_auth)
    assert config.worker.cluster_auth.requires_token
    assert config.ray == RayConfig()
    # No backend named: TCP on CPU engines.
    assert config.worker.kv_backend is None


def test_flags_land_in_the_tree(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    config = config_of(
        tiny_model_dir,
        "--device", "cpu", "--kv-backend", "tcp", "--prefill", "2", "--decode", "3",
        "--host", "0.0.0.0", "--grpc-port", "0", "--http-port", "0", "--threads", "2",
        "--max-model-len", "300", "--max-num-batched-tokens", "128",
        "--trace-exporter", "console", "--admission", "queue", "--ttft-slo", "0.5",
        "--itl-slo", "0.05", "--max-local-prefill-tokens", "0", "--api-key", "k",
        "--ray-address", "auto", "--kv-cache-memory", "48MiB", "--dtype", "float32",
        "--step-watchdog", "900",
    )  # fmt: skip
    assert config.ray.address == "auto"
    assert config.worker.step_watchdog_s == 900.0
    assert config.engine.kv_cache_memory_bytes == 48 << 20
    # The tiny model keeps 4 KiB of K and V per token (4 layers x 2 heads x 64 x 2 x 4 B).
    assert config.engine.num_blocks == (48 << 20) // (4096 * config.engine.block_size)
    assert config.pools == PoolsConfig(num_prefill=2, num_decode=3)
    assert (config.engine.max_model_len, config.engine.max_num_batched_tokens) == (300, 128)
    assert config.engine.num_threads == 2
    assert config.worker.kv_backend is KvBackend.TCP
    assert config.worker.host == config.router.host == "0.0.0.0"
    assert config.worker.trace_exporter is config.router.trace_exporter is TraceExporter.CONSOLE
    router = config.router
    assert router.admission_policy is AdmissionPolicy.QUEUE
    assert (router.ttft_slo_s, router.itl_slo_s, router.api_key) == (0.5, 0.05, "k")
    assert router.max_local_prefill_tokens == 0


def test_pool_flags_are_the_starting_targets_and_budget(tiny_model_dir):
    config = config_of(
        tiny_model_dir, "--device", "cpu", "--prefill", "2", "--decode", "3",
        "--max-workers-per-role", "5", "--autoscaling",
    )  # fmt: skip
    assert config.pools == PoolsConfig(num_prefill=2, num_decode=3, max_workers_per_role=5)
    assert config.ray.autoscaling and config.ray.role_resources is True
    colocated = config_of(tiny_model_dir, "--device", "cpu", "--colocated", "3",
                          "--max-workers-per-role", "3")  # fmt: skip
    assert colocated.pools.num_colocated == 3 and colocated.pools.max_workers_per_role == 3
    assert colocated.ray.role_resources is None  # local: whatever Ray declares
    no_backoff = config_of(tiny_model_dir, "--device", "cpu", "--restart-backoff", "0")
    assert no_backoff.pools == PoolsConfig(restart_backoff_s=0.0)


def test_colocated_pools(tiny_model_dir):
    config = config_of(tiny_model_dir, "--device", "cpu", "--colocated", "2")
    assert config.roles == [WorkerRole.COLOCATED, WorkerRole.COLOCATED]


def test_without_chunking_the_budget_covers_the_longest_prompt(tiny_model_dir):
    limit = EngineConfig(model=str(tiny_model_dir)).max_model_len
    unchunked = config_of(tiny_model_dir, "--device", "cpu", "--no-chunked-prefill").engine
    assert not unchunked.enable_chunked_prefill
    assert unchunked.max_num_batched_tokens == limit
    capped = config_of(
        tiny_model_dir, "--device", "cpu", "--no-chunked-prefill", "--max-model-len", "300"
    ).engine
    assert capped.max_num_batched_tokens == 300


def test_an_explicit_budget_too_small_for_unchunked_prompts_is_refused(tiny_model_dir, capsys):
    err = refused(
        capsys, tiny_model_dir, "--device", "cpu", "--no-chunked-prefill",
        "--max-num-batched-tokens", "64",
    )  # fmt: skip
    assert "max_num_batched_tokens" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--kv-backend", "local"), "invalid choice: 'local'"),
        (("--device", "tpu"), "invalid choice: 'tpu'"),
        (("--admission", "maybe"), "invalid choice: 'maybe'"),
        (("--trace-exporter", "jaeger"), "invalid choice: 'jaeger'"),
        (("--prefill", "0"), "--prefill: must be >= 1, got 0"),
        (("--decode", "-1"), "--decode: must be >= 1, got -1"),
        (("--colocated", "two"), "--colocated: expected an integer >= 1, got 'two'"),
        (("--threads", "0"), "--threads: must be >= 1"),
        (("--grpc-port", "70000"), "--grpc-port: must be a port in [0, 65535]"),
        (("--max-local-prefill-tokens", "-5"), "--max-local-prefill-tokens: must be >= 0"),
        (("--ttft-slo", "0"), "--ttft-slo: must be > 0"),
        (("--step-watchdog", "0"), "--step-watchdog: must be > 0"),
        (("--step-watchdog", "-5"), "--step-watchdog: must be > 0, got -5.0"),
        (("--step-watchdog", "inf"), "--step-watchdog: must be a finite number, got inf"),
        (("--colocated", "2", "--prefill", "1"), "--colocated replaces the --prefill/--decode"),
        (("--colocated", "1", "--decode", "1"), "--colocated replaces the --prefill/--decode"),
        (("--device", "cpu", "--kv-backend", "nccl"), "--kv-backend nccl moves KV between GPUs"),
        (("--device", "cpu", "--kv-backend", "cuda_ipc"), "--kv-backend cuda_ipc moves KV"),
        (("--device", "cpu", "--cuda-graphs", "on"), "cuda_graphs on needs a CUDA device"),
        (("--gpus-per-worker", "1.5"), "ray.gpus_per_worker must be in (0, 1] or whole"),
        (("--gpus-per-worker", "nan"), "ray.gpus_per_worker must be in (0, 1] or whole"),
        (("--max-workers-per-role", "0"), "--max-workers-per-role: must be >= 1"),
        (("--restart-backoff", "-1"), "--restart-backoff: must be >= 0, got -1.0"),
        # Config errors name the flags that set the fields.
        (("--decode", "4", "--max-workers-per-role", "3"), "--decode (4) is over --max-workers-"),
        (("--planner", "auto", "--max-workers", "1"), "--max-workers must be >= 2 (one per role)"),
        (("--kv-cache-memory", "lots"), "--kv-cache-memory: expected bytes or a size like"),
        (("--kv-cache-memory", "0MiB"), "--kv-cache-memory: must be at least 1 byte"),
        (("--grpc-port", "8000", "--http-port", "8000"), "grpc_port and http_port must differ"),
        (
            ("--planner", "auto", "--max-workers", "9", "--max-workers-per-role", "4"),
            "--max-workers (9) cannot be split with at most --max-workers-per-role (4)",
        ),
        (
            ("--planner", "observe", "--prefill", "2", "--decode", "2", "--max-workers", "3"),
            "--max-workers (3) is below the 4 prefill + decode workers the pools start",
        ),
        # An empty key (an unset shell variable) must not mean an open server.
        (("--api-key", ""), "--api-key is empty"),
        (("--api-key", "  "), "--api-key is empty"),
        # 1 MiB holds 256 tokens of the tiny model in float32 (auto is bfloat16 on CPUs
        # with bf16 GEMM instructions), its max_model_len is 2048.
        (
            ("--kv-cache-memory", "1MiB", "--dtype", "float32"),
            "holds 256 tokens (65536 bytes per 16-token block), fewer than max_model_len 2048",
        ),
    ],
)
def test_flags_the_cli_refuses(tiny_model_dir, capsys, flags, message):
    err = refused(capsys, tiny_model_dir, *flags)
    assert "usage: tandem serve" in err
    assert message in err


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [("65536", 65536), ("512MiB", 512 << 20), ("4Gi", 4 << 30), ("2GB", 2 * 10**9),
     ("1.5GiB", 3 << 29), ("64 mib", 64 << 20), ("70K", 70000), ("64KiB", 65536)],
)  # fmt: skip
def test_kv_cache_memory_takes_bytes_or_a_unit(tiny_model_dir, text, num_bytes):
    # At least one 16-token block of the tiny model (64 KiB), the longest sequence here.
    config = config_of(tiny_model_dir, "--device", "cpu", "--kv-cache-memory", text,
                       "--max-model-len", "16")  # fmt: skip
    assert config.engine.kv_cache_memory_bytes == num_bytes


def test_a_kv_cache_for_the_longest_sequence_starts(tiny_model_dir):
    # 1 MiB: 16 blocks of 16 float32 tokens, enough for max_model_len 256 and no more.
    engine = config_of(tiny_model_dir, "--device", "cpu", "--kv-cache-memory", "1MiB",
                       "--max-model-len", "256", "--dtype", "float32").engine  # fmt: skip
    assert engine.num_blocks * engine.block_size == 256


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_without_cuda_is_refused(tiny_model_dir, capsys):
    err = refused(capsys, tiny_model_dir, "--device", "cuda")
    assert "--device cuda: this machine has no CUDA device" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_nccl_on_the_default_cpu_device_is_refused(tiny_model_dir, capsys):
    err = refused(capsys, tiny_model_dir, "--kv-backend", "nccl")
    assert "--kv-backend nccl moves KV between GPUs" in err


def test_a_missing_model_directory_is_refused(tmp_path, capsys):
    err = refused(capsys, tmp_path / "nowhere", "--device", "cpu")
    assert "no config.json" in err


def test_pool_metrics_port_is_fixed_by_a_flag(tiny_model_dir):
    # On Kubernetes a PodMonitor scrapes the pool controller on a fixed, named port.
    config = config_of(tiny_model_dir, "--device", "cpu", "--pool-metrics-port", "9101")
    assert config.pools.metrics_port == 9101
    assert config_of(tiny_model_dir, "--device", "cpu").pools.metrics_port == 0


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_a_missing_model_directory_is_one_line_and_exit_2(capsys, tmp_path, command):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--model", str(tmp_path / "nowhere")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "no config.json in model directory" in err and "Traceback" not in err


def test_an_empty_api_key_in_the_environment_is_refused(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEY", "")
    assert "TANDEM_API_KEY is empty" in refused(capsys, tiny_model_dir)
    monkeypatch.setenv("TANDEM_API_KEY", "k")
    assert config_of(tiny_model_dir).router.api_key == "k"
    monkeypatch.delenv("TANDEM_API_KEY")
    assert config_of(tiny_model_dir).router.api_key is None
