"""Shared fixtures: one tiny model and one in-process cluster per test session, the
per-test idle check of any cluster a test used; CUDA-only tests skipped without CUDA;
under pytest-xdist, the scheduling of tests/helpers/parallel.py; the machine named at the
end of the run (CI's output keeps the end), so a failure can be tied to its CPU."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tandem.bench.report import cpu_model
from tandem.engine.dtype import BF16_GEMM_FLAGS, auto_dtype, cpu_flags, cpu_info
from tandem.engine.model_maker import make_model
from tandem.proto.cluster_auth import ClusterAuth, generate_token
from tests.helpers.inproc_cluster import InprocCluster, shared_router_config
from tests.helpers.parallel import DisruptionScheduling

# CI machines are small; more intra-op threads than cores only adds contention.
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset (seed 0), made once per session. Treat it as read-only."""
    return make_model("tiny", tmp_path_factory.mktemp("models") / "tandem-tiny", seed=0)


@pytest.fixture(scope="session")
def cluster(tiny_model_dir: Path) -> Iterator[InprocCluster]:
    """One in-process cluster (1 prefill + 1 decode worker, router; `tiny` model) that
    every API test without special settings shares, started on first use.

    Its HTTP API wants `SHARED_API_KEY`, its workers `cluster.cluster_auth`. Each test
    leaves it idle (checked after every test), so tests stay independent; a module that
    needs other router or engine settings defines its own `cluster` fixture (which
    overrides this one) or starts one.
    """
    model_dir = str(tiny_model_dir)
    # Behind a cluster token, like a served cluster: every API test goes through it.
    cluster = InprocCluster(
        model_dir,
        router_config=shared_router_config(model_dir),
        cluster_auth=ClusterAuth(token=generate_token()),
    )
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def _cluster_idle_after_each_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used a `cluster` fixture: every block free, nothing waiting,
    running, held, importing or streaming on any worker, and no request charged by the
    router's policy (what a leaked request would leave behind)."""
    cluster = request.getfixturevalue("cluster") if "cluster" in request.fixturenames else None
    yield
    if cluster is not None:
        cluster.assert_idle()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_xdist_make_scheduler(config: pytest.Config, log) -> DisruptionScheduling | None:
    """`-n N` (`make test`) in xdist's default mode (`--dist load`): marked modules in one
    process, one at a time (tests/helpers/parallel.py); other `--dist` modes are xdist's."""
    if config.getvalue("dist") == "load":
        return DisruptionScheduling(config, log)
    return None


def pytest_terminal_summary(terminalreporter) -> None:
    flags, info = cpu_flags(), cpu_info()
    family_model = ", ".join(f"{key} {info[key]}" for key in ("cpu family", "model") if key in info)
    bf16_units = ", ".join(sorted(set(BF16_GEMM_FLAGS) & flags)) or "none"
    terminalreporter.write_line(
        f"machine: {cpu_model()} ({family_model}), {os.cpu_count()} CPUs, bf16 GEMM "
        f"instructions: {bf16_units}, CPU dtype auto = {auto_dtype('cpu', 'bfloat16', flags)}"
    )
