"""`load_tokenizer`: the generic fast class directly, everything else through AutoTokenizer,
the same tokenizer either way."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from tandem.engine.tokenizer_loader import load_tokenizer, tokenizer_class_name

TEXT = "Hello world, <s> this is </s> a test  ünïcode 12345"
MESSAGES = [{"role": "user", "content": "Hi there"}]


def _same_tokenizer(a, b) -> None:
    assert type(a) is type(b)
    assert a.encode(TEXT) == b.encode(TEXT)
    assert a.decode(a.encode(TEXT)) == b.decode(b.encode(TEXT))
    assert a.all_special_ids == b.all_special_ids and a.eos_token_id == b.eos_token_id
    assert len(a) == len(b) and a.model_max_length == b.model_max_length
    assert a.apply_chat_template(MESSAGES, add_generation_prompt=True) == (
        b.apply_chat_template(MESSAGES, add_generation_prompt=True)
    )


def test_generic_fast_class_loads_as_autotokenizer_does(tiny_model_dir: Path) -> None:
    assert tokenizer_class_name(tiny_model_dir) == "PreTrainedTokenizerFast"
    _same_tokenizer(load_tokenizer(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir))


def _copy_with_config(model_dir: Path, out: Path, config_text: str) -> Path:
    shutil.copytree(model_dir, out)
    (out / "tokenizer_config.json").write_text(config_text)
    return out


def test_other_classes_go_through_autotokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "LlamaTokenizerFast"
    llama = _copy_with_config(tiny_model_dir, tmp_path / "llama", json.dumps(config))
    assert tokenizer_class_name(llama) == "LlamaTokenizerFast"
    got, want = load_tokenizer(llama), AutoTokenizer.from_pretrained(llama)
    assert type(got).__name__ == type(want).__name__
    assert got.encode(TEXT) == want.encode(TEXT)


def test_configs_without_a_readable_class_go_through_autotokenizer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    no_class = _copy_with_config(tiny_model_dir, tmp_path / "no-class", "{}")
    assert tokenizer_class_name(no_class) is None
    # AutoTokenizer falls back on config.json's model type.
    want = AutoTokenizer.from_pretrained(tiny_model_dir).encode(TEXT)
    assert load_tokenizer(no_class).encode(TEXT) == want
    assert tokenizer_class_name(_copy_with_config(tiny_model_dir, tmp_path / "bad", "{no")) is None
    assert tokenizer_class_name(tmp_path / "missing") is None


def test_loading_skips_transformers_auto_mappings(tiny_model_dir: Path) -> None:
    # What makes it fast: a fresh process never imports AutoTokenizer's class mappings.
    code = (
        "import sys; from tandem.engine.tokenizer_loader import load_tokenizer; "
        f"load_tokenizer({str(tiny_model_dir)!r}); "
        "print('transformers.models.auto.tokenization_auto' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "False", done.stderr
