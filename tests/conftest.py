"""Shared fixtures: one tiny model per test session; CUDA-only tests skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.engine.model_maker import make_model

# CI machines are small; more intra-op threads than cores only adds contention.
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset (seed 0), made once per session. Treat it as read-only."""
    return make_model("tiny", tmp_path_factory.mktemp("models") / "tandem-tiny", seed=0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
