"""The dummy-model maker writes directories that stock `transformers` loads and runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tandem.cluster import cli
from tandem.engine.model_maker import PRESETS, make_model

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "Hello, world! The server decodes 42 tokens.",
    "  leading spaces,\ttabs\nand newlines\r\n",
    "naïve café — “quotes” 你好世界 こんにちは 🙂🚀👩‍💻",
    "",
]


def tandem_command() -> list[str]:
    """The installed `tandem` console script, else the same entry point via `-m`."""
    script = Path(sys.executable).with_name("tandem")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tandem.cluster.cli"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_config_matches_preset(tiny_model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_model_dir)
    spec = PRESETS["tiny"]
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size) == (spec.num_layers, spec.hidden_size)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.vocab_size == 2048 and config.tie_word_embeddings
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    assert raw["rope_theta"] == 10000.0
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    assert (tiny_model_dir / "model.safetensors").is_file()


def test_model_loads_with_expected_size_and_runs(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert model.dtype == torch.float32
    num_params = sum(p.numel() for p in model.parameters())
    assert 2_500_000 < num_params < 4_000_000
    with torch.no_grad():
        logits = model(torch.tensor([[1, 100, 200, 300]])).logits[0, -1]
    assert logits.shape == (2048,)
    assert 3.0 < logits.std().item() < 7.0  # wide logits: no near-ties under greedy
    top2 = logits.topk(2).values
    assert (top2[0] - top2[1]).item() > 1e-3


def test_greedy_output_varies(tiny_model_dir: Path, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=2)
    assert len(set(out[0, ids.shape[1] :].tolist())) > 4


def test_same_seed_same_weights_other_seed_differs(tmp_path: Path) -> None:
    a = make_model("tiny", tmp_path / "a", seed=3)
    b = make_model("tiny", tmp_path / "b", seed=3)
    c = make_model("tiny", tmp_path / "c", seed=4)
    weights = [(d / "model.safetensors").read_bytes() for d in (a, b, c)]
    assert weights[0] == weights[1] != weights[2]
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_unknown_preset_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        make_model("huge", tmp_path)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_text(tokenizer, text: str) -> None:
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_prepends_bos_only(tokenizer) -> None:
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (1, 2, 0)
    assert tokenizer.pad_token_id is not None
    ids = tokenizer("hello world").input_ids
    assert ids[0] == 1 and ids.count(1) == 1 and 2 not in ids
    assert tokenizer("hello world", add_special_tokens=False).input_ids == ids[1:]


def test_tokenizer_compresses_english(tokenizer) -> None:
    text = "the people could go to the water and find the light"
    assert len(tokenizer(text, add_special_tokens=False).input_ids) <= len(text.split()) + 2


def test_every_id_decodes(tokenizer) -> None:
    assert len(tokenizer) == 2048
    for token_id in range(2048):
        assert isinstance(tokenizer.decode([token_id]), str)
    normal_ids = range(5, 2048)  # after <unk> <s> </s> <|im_start|> <|im_end|>
    assert all(tokenizer.decode([i], skip_special_tokens=True) for i in normal_ids)


def test_chat_template_renders(tiny_model_dir: Path, tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 🙂"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert not no_prompt.endswith("assistant\n")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids[:2] == [1, tokenizer.convert_tokens_to_ids("<|im_start|>")]
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert "chat_template" in config


@pytest.mark.timeout(180)
def test_cli_model_make(tmp_path: Path) -> None:
    out_dir = tmp_path / "cli-tiny"
    result = subprocess.run(
        [
            *tandem_command(),
            "model",
            "make",
            "--preset",
            "tiny",
            "--out",
            str(out_dir),
            "--seed",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out_dir)
    assert AutoConfig.from_pretrained(out_dir).vocab_size == 2048
    assert AutoTokenizer.from_pretrained(out_dir)("hi").input_ids[0] == 1


def test_cli_rejects_unknown_preset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["model", "make", "--preset", "huge", "--out", str(tmp_path / "x")]) == 2
    assert "unknown preset" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
