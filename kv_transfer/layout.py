"""The KV layout two workers must share before blocks can move between them.

A channel is opened only when the prefill and decode workers agree on every field;
the fingerprint is the string form carried in `KvHandle.layout_fingerprint` and
`OpenChannelRequest.layout_fingerprint`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tandem.kv_transfer.errors import LayoutMismatchError

if TYPE_CHECKING:
    from tandem.engine.config import EngineConfig

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# config.json keys that change with the saving tool or checkpoint precision, not with
# the architecture (the runtime KV dtype is its own field).
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "torch_dtype", "dtype")


def dtype_name(dtype: torch.dtype) -> str:
    """ "float32" for torch.float32; only the KV dtypes of `DTYPES` are accepted."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unsupported KV dtype {dtype}; supported: {sorted(DTYPES)}")
    return name


@dataclass(frozen=True)
class KvLayout:
    """Shape and meaning of one worker's KV blocks."""

    # Weights' architecture: model dir basename + short hash of its config.json.
    model: str
    dtype: str
    # Tokens per block.
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if not self.model or any(c in self.model for c in ";="):
            raise ValueError(f"model must be non-empty without ';' or '=', got {self.model!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> KvLayout:
        mc = config.model_config
        return cls(
            model=model_id(config.model),
            dtype=dtype_name(config.torch_dtype),
            block_size=config.block_size,
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def block_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of `num_blocks` blocks: [layers, 2 (K, V), blocks, block_size, heads, dim]."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def block_nbytes(self, num_blocks: int) -> int:
        per_elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return (
            per_elem
            * num_blocks
            * 2
            * self.num_layers
            * (self.block_size * self.num_kv_heads * self.head_dim)
        )

    def fingerprint(self) -> str:
        return ";".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    @classmethod
    def from_fingerprint(cls, fingerprint: str) -> KvLayout:
        """Inverse of `fingerprint`; ValueError when a field is missing, unknown or bad."""
        values: dict[str, str] = {}
        for part in fingerprint.split(";"):
            key, sep, value = part.partition("=")
            if not sep or key in values:
                raise ValueError(f"malformed KV layout fingerprint {fingerprint!r}")
            values[key] = value
        names = [f.name for f in fields(cls)]
        if sorted(values) != sorted(names):
            raise ValueError(
                f"KV layout fingerprint {fingerprint!r} must have exactly the fields {names}"
            )
        ints = {n: _parse_int(n, values[n]) for n in names if n not in ("model", "dtype")}
        return cls(model=values["model"], dtype=values["dtype"], **ints)

    def check_matches(
        self, other_fingerprint: str, *, self_role: str = "local", other_role: str = "remote"
    ) -> None:
        """Raise LayoutMismatchError naming every differing field with both values."""
        if other_fingerprint == self.fingerprint():
            return
        try:
            other = KvLayout.from_fingerprint(other_fingerprint)
        except ValueError as e:
            raise LayoutMismatchError(f"KV layout mismatch: {other_role} sent {e}") from e
        diffs = [
            f"{f.name}: {self_role}={getattr(self, f.name)} {other_role}={getattr(other, f.name)}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        raise LayoutMismatchError("KV layout mismatch: " + "; ".join(diffs))


def model_id(model_dir: str | Path) -> str:
    """`<basename>-<8 hex of sha256(canonical config.json)>`: equal for equal architectures."""
    path = Path(model_dir)
    raw = json.loads((path / "config.json").read_text())
    for key in _VOLATILE_CONFIG_KEYS:
        raw.pop(key, None)
    canonical = json.dumps(raw, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:8]
    name = path.resolve().name.replace(";", "_").replace("=", "_") or "model"
    return f"{name}-{digest}"


def _parse_int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"KV layout field {name} must be an int, got {value!r}") from None
