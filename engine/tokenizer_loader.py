"""The served model's tokenizer, as `AutoTokenizer` loads it, in a fraction of its time.

`AutoTokenizer.from_pretrained` first resolves the tokenizer class through transformers'
auto mappings, whose first use in a process imports the lazy structure of every model
transformers ships: ~1.5-2.5 s of a worker's or router's start on a 2-core machine, more
than the rest of a tiny model's engine start. A checkpoint whose tokenizer_config.json
names the generic fast class (`PreTrainedTokenizerFast`: Tandem's own models, Llama 3)
needs none of that: the class is loaded directly, the same class with the same files as
`AutoTokenizer` gives. Every other checkpoint goes through `AutoTokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# tokenizer_config.json's class names that mean transformers' generic fast tokenizer.
GENERIC_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(model_dir: str | Path, **kwargs: Any) -> Any:
    """The tokenizer of the checkpoint in `model_dir` (`kwargs` as `from_pretrained`'s)."""
    if tokenizer_class_name(model_dir) in GENERIC_FAST_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir), **kwargs)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), **kwargs)


def tokenizer_class_name(model_dir: str | Path) -> str | None:
    """The `tokenizer_class` tokenizer_config.json names, or None (no such file or key,
    or a file that does not parse: `AutoTokenizer` then decides, and reports what is
    wrong)."""
    path = Path(model_dir) / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None
