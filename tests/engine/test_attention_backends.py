"""Choosing the attention backend: auto picks, and a backend that cannot run here is an
error at start-up (config, `tandem serve`, `tandem demo`), never a silent fallback."""

from __future__ import annotations

import sys

import pytest

from tandem.cluster.cli import main
from tandem.engine.attention import AttentionBackendName, resolve_attention_backend
from tandem.engine.attention.cpu_paged_backend import CpuPagedAttentionBackend
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import Engine


@pytest.fixture
def no_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_auto_is_cpu_on_cpu_and_torch_is_torch(no_interpreter) -> None:
    assert resolve_attention_backend("auto", "cpu") is AttentionBackendName.CPU
    assert resolve_attention_backend("torch", "cpu") is AttentionBackendName.TORCH


def test_unknown_backend_names_the_choices() -> None:
    choices = "auto, torch, triton, cpu"
    with pytest.raises(ValueError, match=f"attention_backend must be one of {choices}"):
        resolve_attention_backend("flash", "cpu")


def test_triton_on_cpu_needs_the_interpreter(no_interpreter, monkeypatch) -> None:
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_attention_backend("triton", "cpu") is AttentionBackendName.TRITON


def test_triton_that_does_not_import_is_an_error(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    with pytest.raises(ValueError, match="triton cannot be imported"):
        resolve_attention_backend("triton", "cpu")
    # auto on CUDA falls back to torch, saying so (auto promises the best that runs).
    assert resolve_attention_backend("auto", "cuda") is AttentionBackendName.TORCH


def test_engine_config_refuses_at_construction(tiny_model_dir, no_interpreter) -> None:
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        EngineConfig(model=str(tiny_model_dir), attention_backend="triton")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(model=str(tiny_model_dir), attention_backend="sdpa")
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=64, num_blocks=8)
    assert config.attention_backend == "auto"
    assert config.resolved_attention_backend == "cpu"
    engine = Engine(config)
    assert isinstance(engine.runner.attention_backend, CpuPagedAttentionBackend)


def test_triton_interpreter_refuses_bfloat16(tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="bfloat16"):
        EngineConfig(model=str(tiny_model_dir), attention_backend="triton", dtype="bfloat16")
    config = EngineConfig(model=str(tiny_model_dir), attention_backend="triton", dtype="float16")
    assert config.resolved_attention_backend == "triton"


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_cli_refuses_triton_on_cpu_without_interpreter(
    command, tiny_model_dir, no_interpreter, capsys
) -> None:
    argv = [command, "--model", str(tiny_model_dir), "--device", "cpu"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--attention-backend", "triton"])
    assert exit_info.value.code == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--attention-backend", "cuda-graphs"])
    assert exit_info.value.code == 2
    assert "--attention-backend: invalid choice" in capsys.readouterr().err
