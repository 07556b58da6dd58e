"""The cluster's typed configuration tree: validation names the field, defaults are
defined once, and the engine template becomes one engine per role."""

from __future__ import annotations

import dataclasses
import re

import pytest

from tandem.cluster.config import ClusterConfig, PoolsConfig, RayConfig
from tandem.engine.config import EngineConfig, EngineMode
from tandem.router.config import RouterConfig
from tandem.worker.config import KvBackend, WorkerConfig, WorkerRole, WorkerSettings


def test_pools_roles_and_conflicts():
    assert PoolsConfig().roles == [WorkerRole.PREFILL, WorkerRole.DECODE]
    assert PoolsConfig.colocated(3).roles == [WorkerRole.COLOCATED] * 3
    with pytest.raises(ValueError, match="colocated workers replace the prefill/decode pools"):
        PoolsConfig(num_colocated=2)
    with pytest.raises(ValueError, match="num_prefill >= 1 and num_decode >= 1"):
        PoolsConfig(num_prefill=0)
    with pytest.raises(ValueError, match=r"pools\.num_decode must be >= 0"):
        PoolsConfig(num_decode=-1)


def test_ray_config_validation():
    with pytest.raises(ValueError, match=r"ray\.gpus_per_worker"):
        RayConfig(gpus_per_worker=1.5)
    with pytest.raises(ValueError, match=r"ray\.worker_start_timeout_s"):
        RayConfig(worker_start_timeout_s=0)


def test_cluster_fills_engine_and_router_from_model_dir(tiny_model_dir):
    config = ClusterConfig(model_dir=str(tiny_model_dir))
    assert config.engine.model == str(tiny_model_dir)
    assert config.router.model_dir == str(tiny_model_dir)


def test_cluster_refuses_parts_for_another_model(tiny_model_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"engine.model .* must be model_dir"):
        ClusterConfig(model_dir=str(tiny_model_dir), engine=EngineConfig(model=str(other)))
    with pytest.raises(ValueError, match=r"router.model_dir .* must be model_dir"):
        ClusterConfig(model_dir=str(tiny_model_dir), router=RouterConfig(model_dir=str(other)))


def test_worker_settings_refuse_backends_no_worker_can_run(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_backend local moves KV between engines inside one"):
        WorkerSettings(kv_backend="local")
    choices = "auto, tcp, nccl, cuda_ipc, local"
    with pytest.raises(ValueError, match=f"kv_backend must be one of {choices}"):
        WorkerSettings(kv_backend="udp")
    with pytest.raises(ValueError, match="kv_backend nccl needs GPU engines"):
        ClusterConfig(
            model_dir=str(tiny_model_dir),
            engine=EngineConfig(model=str(tiny_model_dir)),
            worker=WorkerSettings(kv_backend=KvBackend.NCCL),
        )
    with pytest.raises(ValueError, match="trace_exporter must be one of none, console, otlp"):
        WorkerSettings(trace_exporter="jaeger")


def test_worker_config_checks_role_against_engine_mode(tiny_model_dir):
    engine = EngineConfig(model=str(tiny_model_dir), mode=EngineMode.DECODE_ONLY)
    config = WorkerConfig(worker_id="d0", role="decode", engine=engine)
    assert config.role is WorkerRole.DECODE
    # No backend named: TCP for CPU engines.
    assert config.kv_backend is KvBackend.TCP
    with pytest.raises(ValueError, match=r"engine\.mode: a prefill worker needs engine mode"):
        WorkerConfig(worker_id="p0", role=WorkerRole.PREFILL, engine=engine)
    with pytest.raises(ValueError, match="role must be one of prefill, decode, colocated"):
        WorkerConfig(worker_id="x", role="router", engine=engine)


def test_engine_template_becomes_one_engine_per_role(tiny_model_dir):
    """What `LocalCluster` does per worker: the template with the role's mode."""
    template = EngineConfig(model=str(tiny_model_dir), max_model_len=300, block_size=32)
    for role in WorkerRole:
        engine = dataclasses.replace(template, mode=role.engine_mode, num_threads=1)
        assert engine.mode is role.engine_mode
        assert (engine.max_model_len, engine.block_size) == (300, 32)
        assert engine.num_blocks == template.num_blocks


def test_router_config_validation(tiny_model_dir):
    with pytest.raises(ValueError, match="admission_policy must be one of shed, queue, none"):
        RouterConfig(model_dir=str(tiny_model_dir), admission_policy="maybe")
    with pytest.raises(ValueError, match="ttft_slo_s must be > 0"):
        RouterConfig(model_dir=str(tiny_model_dir), ttft_slo_s=0)
    for wait_s in (-1.0, 1801.0):
        with pytest.raises(
            ValueError, match=r"migration_wait_s must be in \[0, request_timeout_s\]"
        ):
            RouterConfig(model_dir=str(tiny_model_dir), migration_wait_s=wait_s)
    assert not hasattr(RouterConfig(model_dir=str(tiny_model_dir)), "block_size")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(max_workers_per_role=0), "pools.max_workers_per_role must be >= 1"),
        (dict(num_decode=9, max_workers_per_role=8), "pools.num_decode (9) is over"),
        (dict(health_interval_s=0), "pools.health_interval_s must be > 0"),
        (dict(health_timeout_s=-1), "pools.health_timeout_s must be > 0"),
        (dict(drain_timeout_s=0), "pools.drain_timeout_s must be > 0"),
        (dict(dead_retention_s=-1), "pools.dead_retention_s must be >= 0"),
        (dict(restart_backoff_s=-1), "pools.restart_backoff_s must be >= 0"),
        (dict(restart_stable_s=-0.5), "pools.restart_stable_s must be >= 0"),
        (dict(max_health_failures=0), "pools.max_health_failures must be >= 1"),
        (dict(metrics_port=70000), "pools.metrics_port must be in"),
    ],
)
def test_pool_controller_settings_are_checked(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PoolsConfig(**fields)
