"""The sampling values a request gets for the fields it leaves out.

A model directory's `generation_config.json` may name the sampling its authors tuned it
for (Llama 3 Instruct: temperature 0.6, top_p 0.9; Qwen2.5 Instruct: 0.7, 0.8, top_k
20, repetition_penalty 1.05). As vLLM does by default (`--generation-config auto`), the
router applies the ones the file names (`temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`) to every request that leaves the field out, on every API; the
others keep OpenAI's defaults (temperature 1, top_p 1, no top_k or min_p, no repetition
penalty). `--generation-config off` ignores the file.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tandem.engine.sampling_params import SamplingParams


class GenerationConfigUse(enum.StrEnum):
    """Whether the model's generation_config.json sets the sampling defaults."""

    AUTO = "auto"
    OFF = "off"


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    # 0: off.
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def of_model(cls, model_dir: str | Path, use: GenerationConfigUse) -> SamplingDefaults:
        """The defaults `use` takes from the model directory; ValueError naming the file
        and field for a value no request could give."""
        path = Path(model_dir) / "generation_config.json"
        if use is GenerationConfigUse.OFF or not path.is_file():
            return cls()
        raw = json.loads(path.read_text())
        values = {
            f.name: _checked(path, f.name, raw[f.name])
            for f in fields(cls)
            if raw.get(f.name) is not None
        }
        if values.get("top_k") == -1:  # "off", which this class writes 0
            values["top_k"] = 0
        return cls(**values)

    def from_model(self) -> dict[str, float]:
        """The values that differ from OpenAI's defaults (what the model's file set)."""
        plain = SamplingDefaults()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != getattr(plain, f.name)
        }


# OpenAI's defaults: what a request gets without a model file (or with it off).
OPENAI_DEFAULTS = SamplingDefaults()


def _checked(path: Path, name: str, value: Any) -> Any:
    """`value` if a request could give it for `name` (SamplingParams decides), else
    ValueError naming the file and field."""
    try:
        if isinstance(value, bool):  # JSON true/false is no sampling value
            raise ValueError(f"{name} must be a number, got {value!r}")
        SamplingParams(max_tokens=1, **{name: value})
    except (TypeError, ValueError, OverflowError) as exc:  # (Overflow: 10**400)
        raise ValueError(
            f"{path}: {name} = {value!r} is not a valid sampling default ({exc}; run with "
            "--generation-config off to ignore the file)"
        ) from None
    return value if name == "top_k" else float(value)
