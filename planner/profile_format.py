"""The `profile.json` that `tandem profile` writes and `tandem plan` reads.

    {"format": "tandem-profile", "version": 1,
     "hardware": {"device": "cpu", "processor": "...", "num_threads": 2, "dtype": "float32",
                  "torch": "2.13.0"},
     "model": {"path": "...", "num_layers": 4, "kv_bytes_per_token": 4096},
     "engine": {"block_size": 16, "max_num_batched_tokens": 512, "max_num_seqs": 64,
                "num_blocks": 4096, "max_model_len": 2048},
     "prefill":  [{"prompt_tokens": 512, "cached_tokens": 0, "seconds": 0.05}, ...],
     "decode":   [{"batch_size": 8, "context_tokens": 4096, "seconds": 0.02}, ...],
     "transfer": [{"num_tokens": 512, "num_bytes": 2097152, "seconds": 0.004}, ...]}

`prefill.seconds` is one engine step prefilling `prompt_tokens - cached_tokens` tokens
of one prompt whose first `cached_tokens` hit the prefix cache; `decode.seconds` one
decode step of `batch_size` sequences holding `context_tokens` tokens in total;
`transfer.seconds` one KV pull between two workers. `load_profile` refuses a file that
is not such a profile with `ProfileError` naming the file and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROFILE_FORMAT = "tandem-profile"
PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file that is missing, foreign or malformed (the message names it)."""


@dataclass(frozen=True)
class PrefillSample:
    prompt_tokens: int
    # Leading prompt tokens served by the prefix cache (not computed).
    cached_tokens: int
    seconds: float


@dataclass(frozen=True)
class DecodeSample:
    batch_size: int
    # Context tokens of the whole batch (sum of sequence lengths).
    context_tokens: int
    seconds: float


@dataclass(frozen=True)
class TransferSample:
    num_tokens: int
    num_bytes: int
    seconds: float


@dataclass(frozen=True)
class EngineLimits:
    """The engine settings the profile was measured with (the simulator uses them)."""

    block_size: int
    # Token budget of one engine step (chunked prefill splits prompts to fit it).
    max_num_batched_tokens: int
    max_num_seqs: int
    # KV blocks per worker.
    num_blocks: int
    max_model_len: int


@dataclass(frozen=True)
class Profile:
    hardware: dict[str, Any]
    model: dict[str, Any]
    engine: EngineLimits
    prefill: tuple[PrefillSample, ...]
    decode: tuple[DecodeSample, ...]
    transfer: tuple[TransferSample, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "hardware": self.hardware,
            "model": self.model,
            "engine": asdict(self.engine),
            "prefill": [asdict(s) for s in self.prefill],
            "decode": [asdict(s) for s in self.decode],
            "transfer": [asdict(s) for s in self.transfer],
        }


def save_profile(profile: Profile, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    return path


def load_profile(path: str | Path) -> Profile:
    """The profile at `path`; ProfileError (naming the file and field) when it is not one."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"{path}: no such profile file (make one with `tandem profile`)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: not a JSON profile ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != PROFILE_FORMAT:
        raise ProfileError(
            f'{path}: not a Tandem profile ("format" must be {PROFILE_FORMAT!r}; '
            "make one with `tandem profile`)"
        )
    if raw.get("version") != PROFILE_VERSION:
        raise ProfileError(f"{path}: profile version {raw.get('version')!r} is not supported "
                           f"(this Tandem reads version {PROFILE_VERSION})")  # fmt: skip
    try:
        profile = Profile(
            hardware=_object(raw, "hardware"),
            model=_object(raw, "model"),
            engine=EngineLimits(**_numbers(_object(raw, "engine"), EngineLimits, "engine")),
            prefill=tuple(_samples(raw, "prefill", PrefillSample)),
            decode=tuple(_samples(raw, "decode", DecodeSample)),
            transfer=tuple(_samples(raw, "transfer", TransferSample, required=False)),
        )
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{path}: {exc}") from None
    if profile.engine.block_size < 1 or profile.engine.max_num_batched_tokens < 1:
        raise ProfileError(f"{path}: engine.block_size and max_num_batched_tokens must be >= 1")
    return profile


def _object(raw: dict[str, Any], name: str) -> dict[str, Any]:
    value = raw.get(name)
    if not isinstance(value, dict):
        raise ValueError(f"field {name!r} must be an object")
    return value


def _numbers(row: Any, kind: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise ValueError(f"{where} must be an object")
    out: dict[str, Any] = {}
    for name, spec in kind.__dataclass_fields__.items():
        value = row.get(name)
        wanted = float if spec.type == "float" else int
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}.{name} must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}.{name} must be finite and >= 0, got {value!r}")
        out[name] = wanted(value)
    return out


def _samples(raw: dict[str, Any], name: str, kind: Any, *, required: bool = True) -> list[Any]:
    rows = raw.get(name, None if required else [])
    if not isinstance(rows, list) or (required and not rows):
        raise ValueError(f"field {name!r} must be a non-empty list of samples")
    return [kind(**_numbers(row, kind, f"{name}[{i}]")) for i, row in enumerate(rows)]
