"""Decode CUDA graphs: the pure logic (mode, buckets, padding) and, on CPU under Triton's
interpreter, the static-buffer path they replay (padded batches, fixed split plan) run
eagerly inside the engine, against the plain eager engine and transformers. Only the
capture and replay themselves need a GPU (`tandem-bench gpu-check`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.engine.config import EngineConfig
from tandem.engine.cuda_graphs import (
    PAD_SLOT,
    choose_bucket,
    graph_batch_sizes,
    pad_decode_metadata,
    resolve_cuda_graphs,
)
from tests.helpers.hf_reference import hf_greedy
from tests.helpers.prompts import make_prompts
from tests.helpers.triton_interpreter import interpreter_process

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 6
# Under the interpreter every kernel step is slow: fewer tokens, a shorter cache.
INTERPRETED_MAX_TOKENS = 4
INTERPRETED_MAX_MODEL_LEN = 128


def test_mode_resolution_and_refusals() -> None:
    assert resolve_cuda_graphs("auto", "cuda", "triton") is True
    assert resolve_cuda_graphs("auto", "cuda:1", "torch") is False
    assert resolve_cuda_graphs("auto", "cpu", "triton") is False
    assert resolve_cuda_graphs("off", "cuda", "triton") is False
    assert resolve_cuda_graphs("on", "cuda:0", "triton") is True
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_cuda_graphs("on", "cpu", "triton")
    with pytest.raises(ValueError, match="needs attention_backend triton"):
        resolve_cuda_graphs("on", "cuda", "torch")
    with pytest.raises(ValueError, match="cuda_graphs must be one of auto, on, off"):
        resolve_cuda_graphs("yes", "cuda", "triton")


def test_engine_config_refuses_graphs_on_cpu(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="cuda_graphs on needs a CUDA device"):
        EngineConfig(model=str(tiny_model_dir), cuda_graphs="on")
    assert not EngineConfig(model=str(tiny_model_dir)).use_cuda_graphs


def test_buckets() -> None:
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(1000, max_graph_batch=40) == [1, 2, 4, 8, 16, 32, 40]
    sizes = graph_batch_sizes(64)
    assert [choose_bucket(n, sizes) for n in (1, 3, 5, 8, 9, 33, 64)] == [1, 4, 8, 8, 16, 48, 64]
    assert choose_bucket(65, sizes) is None
    assert choose_bucket(0, sizes) is None


def test_padding() -> None:
    padded = pad_decode_metadata([17, 3], [[5, 2], [7]], bucket=4, width=3)
    assert padded.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert padded.seq_lens.tolist() == [17, 3, 1, 1]
    assert padded.block_tables.tolist() == [[5, 2, 0], [7, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert padded.seq_lens.dtype == padded.block_tables.dtype == torch.int32
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode_metadata([1, 1, 1], [[0], [0], [0]], bucket=2, width=3)
    with pytest.raises(ValueError, match="exceeds width"):
        pad_decode_metadata([1], [[0, 1, 2, 3]], bucket=1, width=3)


def greedy_both_ways(model_dir: str, prompts: list[list[int]]) -> dict[str, object]:
    """In the interpreter process: greedy tokens of an eager Triton engine, and of one
    whose decode steps run the graphs' static-buffer path (buckets 1, 2, 4; a split-K
    plan of 4 splits fixed for max_model_len); how many steps that path ran."""
    max_model_len = INTERPRETED_MAX_MODEL_LEN
    from tandem.engine.cuda_graphs import DecodeGraphs
    from tandem.engine.generate import generate
    from tandem.engine.llm_engine import Engine
    from tandem.engine.sampling_params import SamplingParams

    def engine() -> Engine:
        config = EngineConfig(
            model=model_dir, attention_backend="triton", dtype="float32",
            max_model_len=max_model_len, max_num_batched_tokens=32, num_blocks=64,
            enable_prefix_caching=False,
        )  # fmt: skip
        return Engine(config)

    params = SamplingParams(max_tokens=INTERPRETED_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    eager = [o.token_ids for o in generate(engine(), prompts, params)]
    graphed = engine()
    runner = graphed.runner
    runner.attention_backend.split_tokens = 32  # 128 / 32: 4 splits, most of them empty
    graphs = DecodeGraphs(
        runner.model, runner.kv_caches, max_num_seqs=4, max_model_len=max_model_len,
        block_size=runner.block_size, capture=False,
    )  # fmt: skip
    runner.decode_graphs = graphs
    tokens = [o.token_ids for o in generate(graphed, prompts, params)]
    return {
        "eager": eager,
        "graphed": tokens,
        "num_runs": graphs.num_runs,
        "num_splits": graphs.num_splits,
    }


def write_with_padding_rows() -> tuple[bool, bool]:
    """In the interpreter process: `write_kv` with PAD_SLOT rows writes the real rows
    and nothing else."""
    from tandem.engine.attention.triton_backend import write_kv

    key, value = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    k_cache, v_cache = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    slots = torch.tensor([5, PAD_SLOT, 0, PAD_SLOT])
    write_kv(key, value, k_cache, v_cache, slots)
    want_k, want_v = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    for row, slot in ((0, 5), (2, 0)):
        want_k[slot // 4, slot % 4], want_v[slot // 4, slot % 4] = key[row], value[row]
    return torch.equal(k_cache, want_k), torch.equal(v_cache, want_v)


@pytest.mark.slow
def test_graph_path_matches_eager_and_transformers(tiny_model_dir: Path) -> None:
    # The longest prompt (36 > max_num_batched_tokens 32) is prefilled in two chunks.
    prompts = make_prompts(2048, (3, 11, 36), seed=3)
    with interpreter_process() as child:
        assert child.submit(write_with_padding_rows).result(timeout=60) == (True, True)
        got = child.submit(greedy_both_ways, str(tiny_model_dir), prompts).result(timeout=240)
    assert got["num_splits"] == 4
    # 3 sequences (bucket 4, one padding row) decode together after their prefills.
    assert isinstance(got["num_runs"], int) and got["num_runs"] >= INTERPRETED_MAX_TOKENS - 2
    assert got["graphed"] == got["eager"]
    assert got["graphed"] == hf_greedy(tiny_model_dir, prompts, INTERPRETED_MAX_TOKENS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_match_eager_on_cuda(tiny_model_dir: Path) -> None:
    from tandem.engine.generate import generate
    from tandem.engine.llm_engine import Engine
    from tandem.engine.sampling_params import SamplingParams

    prompts = make_prompts(2048, (3, 19, 40, 7, 90), seed=4)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = {}
    for mode in ("on", "off"):
        config = EngineConfig(
            model=str(tiny_model_dir), device="cuda", dtype="float32", cuda_graphs=mode
        )
        engine = Engine(config)
        tokens[mode] = [o.token_ids for o in generate(engine, prompts, params)]
        graphs = engine.runner.decode_graphs
        assert (graphs is not None and graphs.num_runs > 0) == (mode == "on")
    assert tokens["on"] == tokens["off"] == hf_greedy(tiny_model_dir, prompts, MAX_TOKENS)
