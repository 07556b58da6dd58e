"""The decode-only C++ stack (engine/model/cpu_decode.py) gives the Python model's numbers
bit for bit: the same tokens and the same float logprobs for batches of 1 to 19 rows
(across the packed matmul's row tile of 6 or 8), on a GQA model with QKV bias, in float32
and bfloat16; it runs only on decode-only steps of a float32 or bfloat16 model with the `cpu`
backend."""

from __future__ import annotations

from pathlib import Path

import pytest
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


@pytest.fixture(scope="module")
def qwen2_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = Qwen2Config(
        vocab_size=2048, hidden_size=128, intermediate_size=320, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rope_theta=1e6,
    )  # fmt: skip
    out = tmp_path_factory.mktemp("models") / "qwen2"
    return save_random_model(Qwen2ForCausalLM, config, out, tiny_model_dir)


class CountingStack:
    """Wraps the engine's stack, counting the steps it ran."""

    def __init__(self, stack) -> None:
        self.stack, self.calls = stack, 0
        self.covers = stack.covers

    def __call__(self, *args):
        self.calls += 1
        return self.stack(*args)


def run(model_dir: Path, prompts: list[list[int]], fused: bool, dtype: str) -> tuple[list, int]:
    config = EngineConfig(
        model=str(model_dir), max_model_len=512, attention_backend="cpu", dtype=dtype
    )
    engine = Engine(config)
    model = engine.runner.model
    assert model.cpu_decode is not None  # float32 or bfloat16 + cpu backend turns it on
    counting = CountingStack(model.cpu_decode) if fused else None
    model.cpu_decode = counting
    outputs = generate(engine, prompts, PARAMS)
    return outputs, counting.calls if counting else 0


@pytest.mark.parametrize(
    ("batch", "dtype"),
    [(1, "float32"), (4, "float32"), (9, "float32"), (19, "float32"), (1, "bfloat16"),
     (16, "bfloat16")],
)  # fmt: skip
def test_stack_equals_the_python_model(qwen2_dir: Path, batch: int, dtype: str) -> None:
    prompts = make_prompts(2048, [5 + 37 * i % 200 for i in range(batch)], seed=batch)
    fused, calls = run(qwen2_dir, prompts, fused=True, dtype=dtype)
    python, _ = run(qwen2_dir, prompts, fused=False, dtype=dtype)
    assert calls >= PARAMS.max_tokens - 2  # every step after the prefills
    for a, b in zip(fused, python, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # exact floats: the same ops in the same order


def test_off_for_other_backends_and_dtypes(tiny_model_dir: Path) -> None:
    for overrides in ({"attention_backend": "torch"}, {"dtype": "float16"}):
        engine = Engine(
            EngineConfig(model=str(tiny_model_dir), max_model_len=256, **with_test_kv(overrides))
        )
        assert engine.runner.model.cpu_decode is None
