"""The one-call C++ decoder stack (engine/model/cpu_stack.py) gives the Python model's
numbers bit for bit: the same tokens and the same float logprobs for batches of 1 to 19
rows (across the packed matmul's row tile of 6 or 8), on a GQA model with QKV bias, in
float32 and bfloat16, for decode steps, prefill steps, chunked prefills after cached
prefixes and steps that mix decodes with a chunk; it runs only for a float32 or bfloat16
model with the `cpu` backend, and only on steps whose chunks the backend attends in place.
Bad layouts are clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tandem.engine.config import EngineConfig
from tandem.engine.generate import generate
from tandem.engine.llm_engine import Engine
from tandem.engine.sampling_params import SamplingParams
from tests.helpers.hf_reference import save_random_model
from tests.helpers.kv_budget import with_test_kv
from tests.helpers.prompts import make_prompts

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True, ignore_eos=True)

pytestmark = pytest.mark.timeout(300)


def save_qwen2(tiny_model_dir: Path, out: Path, tied: bool) -> Path:
    config = Qwen2Config(
        vocab_size=2048, hidden_size=128, intermediate_size=320, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=tied, rope_theta=1e6,
    )  # fmt: skip
    return save_random_model(Qwen2ForCausalLM, config, out, tiny_model_dir)


@pytest.fixture(scope="module")
def qwen2_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_qwen2(tiny_model_dir, tmp_path_factory.mktemp("models") / "qwen2", tied=False)


class CountingStack:
    """Wraps the engine's stack, counting the steps it ran."""

    def __init__(self, stack) -> None:
        self.stack, self.calls = stack, 0
        self.covers = stack.covers

    def __call__(self, *args):
        self.calls += 1
        return self.stack(*args)


def run(
    model_dir: Path, prompts: list[list[int]], fused: bool, dtype: str, **overrides
) -> tuple[list, int, int]:
    """Outputs, steps, and the steps the stack ran."""
    config = EngineConfig(
        model=str(model_dir), max_model_len=512, attention_backend="cpu", dtype=dtype, **overrides
    )
    engine = Engine(config)
    model = engine.runner.model
    assert model.cpu_stack is not None  # float32 or bfloat16 + cpu backend turns it on
    counting = CountingStack(model.cpu_stack) if fused else None
    model.cpu_stack = counting
    steps = 0
    step = engine.step

    def counted_step():
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted_step
    outputs = generate(engine, prompts, PARAMS)
    assert engine.is_idle()
    return outputs, steps, counting.calls if counting else 0


@pytest.mark.parametrize(
    ("batch", "dtype"),
    [(1, "float32"), (4, "float32"), (9, "float32"), (19, "float32"), (1, "bfloat16"),
     (16, "bfloat16")],
)  # fmt: skip
def test_stack_equals_the_python_model(qwen2_dir: Path, batch: int, dtype: str) -> None:
    prompts = make_prompts(2048, [5 + 37 * i % 200 for i in range(batch)], seed=batch)
    fused, steps, calls = run(qwen2_dir, prompts, fused=True, dtype=dtype)
    python, _, _ = run(qwen2_dir, prompts, fused=False, dtype=dtype)
    assert calls == steps  # every step: the backend attends both dtypes' chunks in place
    for a, b in zip(fused, python, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # exact floats: the same ops in the same order


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tied_head_packed_for_the_kernel(
    tiny_model_dir: Path, tmp_path: Path, dtype: str
) -> None:
    """A tied LM head packed for the packed kernel holds the embedding table alone: the op
    reads token rows from its panels, as the Python model's `packed_rows` does."""
    model_dir = save_qwen2(tiny_model_dir, tmp_path / "qwen2-tied", tied=True)
    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=512,
                                 attention_backend="cpu", dtype=dtype))  # fmt: skip
    stack = engine.runner.model.cpu_stack
    if engine.runner.model.embed_tokens is not None:
        pytest.skip("this CPU does not pack bfloat16 weights")
    assert stack is not None and stack.embedding_table.dim() > 2  # the packed panels
    prompts = make_prompts(2048, [5, 70, 131], seed=3)
    fused, steps, calls = run(model_dir, prompts, fused=True, dtype=dtype)
    python, _, _ = run(model_dir, prompts, fused=False, dtype=dtype)
    assert calls == steps
    for a, b in zip(fused, python, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_prefills_after_cached_prefixes(qwen2_dir: Path, dtype: str) -> None:
    """A step budget of 48 tokens splits the prompts into chunks that run beside other
    requests' decodes; shared prefixes hit the prefix cache, so chunks start after cached
    context."""
    shared = make_prompts(2048, [70], seed=7)[0]
    tails = make_prompts(2048, [3, 41, 90, 17], seed=8)
    prompts = [shared + tail for tail in tails] + make_prompts(2048, [9, 130], seed=9)
    overrides = {"max_num_batched_tokens": 48, "enable_prefix_caching": True}
    fused, steps, calls = run(qwen2_dir, prompts, fused=True, dtype=dtype, **overrides)
    python, _, _ = run(qwen2_dir, prompts, fused=False, dtype=dtype, **overrides)
    assert calls == steps
    for a, b in zip(fused, python, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


def test_off_for_other_backends_and_dtypes(tiny_model_dir: Path) -> None:
    for overrides in ({"attention_backend": "torch"}, {"dtype": "float16"}):
        engine = Engine(
            EngineConfig(model=str(tiny_model_dir), max_model_len=256, **with_test_kv(overrides))
        )
        assert engine.runner.model.cpu_stack is None


def test_a_bad_layout_is_an_error(tiny_model_dir: Path) -> None:
    engine = Engine(
        EngineConfig(
            model=str(tiny_model_dir), max_model_len=256,
            **with_test_kv({"attention_backend": "cpu", "dtype": "float32"}),
        )
    )  # fmt: skip
    stack, kv_caches = engine.runner.model.cpu_stack, engine.runner.kv_caches
    assert stack is not None
    table = torch.zeros(1, dtype=torch.int64)
    vocab, max_len = engine.model_config.vocab_size, stack.rope_table.shape[1]

    def call(starts: list[int], lens: list[int], **lists: list[int]) -> None:
        """Four tokens: no decodes, the prefill chunks `starts` and `lens`."""
        step = {
            "token_ids": [1, 2, 3, 4],
            "positions": [0, 1, 2, 3],
            "slots": [0, 1, 2, 3],
            "decode_block_tables": [],
            "decode_seq_lens": [],
            **lists,
        }
        torch.ops.tandem_cpu.decoder_stack(
            stack.embedding_table, vocab, step["token_ids"], stack.rope_table, step["positions"],
            stack.weights, stack.qkv_biases, stack.final_norm, stack.norm_eps, kv_caches,
            step["slots"], step["decode_block_tables"], 1, step["decode_seq_lens"],
            [table] * len(starts), starts, lens, [0] * len(starts),
            stack.scale, stack.num_heads, stack.num_kv_heads,
        )  # fmt: skip

    with pytest.raises(RuntimeError, match="prefill chunk 0 must start at row 0"):
        call([1], [3])
    with pytest.raises(RuntimeError, match="cover 3 of 4 rows"):
        call([0], [3])
    with pytest.raises(RuntimeError, match="prefill chunk 1 must start at row 2"):
        call([0, 3], [2, 1])
    with pytest.raises(RuntimeError, match=f"token id {vocab} outside the vocabulary"):
        call([0], [4], token_ids=[1, 2, vocab, 4])
    with pytest.raises(RuntimeError, match=f"position {max_len} outside the RoPE table's"):
        call([0], [4], positions=[0, 1, 2, max_len])
    with pytest.raises(RuntimeError, match="one position and one slot per token"):
        call([0], [4], slots=[0, 1, 2])
    with pytest.raises(RuntimeError, match="decode_block_tables of 1 values expected, got 0"):
        call([1], [3], decode_seq_lens=[1])
    assert engine.is_idle()
