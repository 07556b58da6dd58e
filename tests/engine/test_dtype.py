"""`dtype="auto"`: bf16 only on CPUs with bf16 GEMM instructions, float32 elsewhere, the
checkpoint's dtype on CUDA; the `--dtype` flags of `tandem serve` / `demo` / bench."""

from __future__ import annotations

import argparse

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.bench.engine.bench import make_plan
from tandem.cluster.cli import build_parser, cluster_config_from_args
from tandem.engine.config import EngineConfig
from tandem.engine.dtype import auto_dtype, cpu_flags, dtype_banner
from tandem.engine.generate import generate
from tandem.engine.llm_engine import Engine
from tandem.engine.sampling_params import SamplingParams
from tandem.worker.config import WorkerRole
from tandem.worker.convert import stats_to_proto
from tests.helpers.prompts import make_prompts

pytestmark = pytest.mark.timeout(300)


def test_auto_follows_the_cpu_flags_and_the_checkpoint_on_cuda() -> None:
    amx = frozenset({"avx512f", "amx_tile", "amx_bf16"})
    zen4 = frozenset({"avx512f", "avx512_vnni", "avx512_bf16"})
    avx512 = frozenset({"avx512f", "avx512_vnni"})
    assert auto_dtype("cpu", "float32", amx) == "bfloat16"
    assert auto_dtype("cpu", "float32", zen4) == "bfloat16"
    assert auto_dtype("cpu", "bfloat16", avx512) == "float32"
    assert auto_dtype("cpu", "bfloat16", frozenset()) == "float32"
    assert auto_dtype("cuda", "float16", frozenset()) == "float16"
    assert auto_dtype("cuda:1", "torch.bfloat16", amx) == "bfloat16"
    assert auto_dtype("cuda", "int8", frozenset()) == "bfloat16"


def test_cpu_flags_are_read_from_cpuinfo(tmp_path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16\nbugs\t: none\n")
    assert cpu_flags(str(info)) == frozenset({"fpu", "avx512f", "amx_bf16"})
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_engine_config_resolves_auto_and_defaults_to_float32(tiny_model_dir) -> None:
    exact = EngineConfig(model=str(tiny_model_dir))
    assert exact.dtype == "float32" and exact.resolved_dtype == "float32"
    assert dtype_banner(exact) == "dtype float32"
    auto = EngineConfig(model=str(tiny_model_dir), dtype="auto")
    assert auto.resolved_dtype == auto_dtype("cpu", "float32")
    assert dtype_banner(auto).startswith(f"dtype {auto.resolved_dtype} (auto: ")
    assert EngineConfig(model=str(tiny_model_dir), dtype="bf16").torch_dtype.itemsize == 2
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(model=str(tiny_model_dir), dtype="int8")
    # Workers report what they run (the router shows it on /v1/models).
    engine = Engine(auto)
    reply = stats_to_proto(engine.stats(), "w0", WorkerRole.DECODE, auto)
    assert reply.dtype == auto.resolved_dtype


def test_dtype_flags(tiny_model_dir) -> None:
    parser = build_parser()
    serve = parser.parse_args(["serve", "--model", str(tiny_model_dir), "--device", "cpu"])
    assert cluster_config_from_args(serve).engine.dtype == "auto"
    serve = parser.parse_args(
        ["serve", "--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "bfloat16"]
    )
    assert cluster_config_from_args(serve).engine.resolved_dtype == "bfloat16"
    demo = parser.parse_args(["demo", "--model", str(tiny_model_dir), "--dtype", "float16"])
    assert demo.dtype == "float16"
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--model", str(tiny_model_dir), "--dtype", "fp8"])
    bench = argparse.Namespace(model=tiny_model_dir, quick=True, dtype="auto")
    assert make_plan(bench).runs == ((auto_dtype("cpu", "float32"), "auto"),)
    bench.dtype = None
    assert make_plan(bench).runs == (("float32", "auto"),)


def test_bf16_engine_matches_transformers_in_bf16(tiny_model_dir) -> None:
    """bf16 rounds differently from fp32, so the reference is transformers in bf16 too;
    the tiny model's separated logits keep greedy argmax clear of near-ties."""
    prompts = make_prompts(2048, (5, 40, 129), seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", max_model_len=1024))
    ours = [out.token_ids for out in generate(engine, prompts, params)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    for prompt, got in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                              min_new_tokens=8, do_sample=False, pad_token_id=2)  # fmt: skip
        assert list(got) == out[0, len(prompt) :].tolist(), f"prompt of {len(prompt)} tokens"
    assert engine.is_idle()
