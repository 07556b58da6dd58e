"""Configuration of one engine instance (shared by prefill, decode and colocated workers).

`EngineConfig` is built once (CLI, tests, worker start-up) and passed down; `ModelConfig`
is the narrow view of a Hugging Face `config.json` that the model runtime needs.
"""

from __future__ import annotations

import enum
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from tandem.engine.attention.selector import resolve_attention_backend
from tandem.engine.cuda_graphs import resolve_cuda_graphs
from tandem.engine.dtype import auto_dtype

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

# Defaults referenced by the CLI and the cluster config (defined here only).
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512

_E = TypeVar("_E", bound=enum.StrEnum)


def parse_enum(kind: type[_E], value: object, name: str) -> _E:
    """`kind(value)` for a config field, or a ValueError naming the field and the choices."""
    choices = ", ".join(member.value for member in kind)
    # A member is a str too; anything else (a number, None) is no choice's value.
    if not isinstance(value, str):
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}") from None


class DeviceKind(enum.StrEnum):
    """Where a cluster's engines run (an engine may also name one GPU, `cuda:N`)."""

    CPU = "cpu"
    CUDA = "cuda"


def default_device() -> DeviceKind:
    """CUDA when this machine has it, else CPU."""
    return DeviceKind.CUDA if torch.cuda.is_available() else DeviceKind.CPU


class EngineMode(enum.StrEnum):
    """What a worker's engine does with a request."""

    # Prefill and decode in one engine, chunked prefill mixed with decodes (the baseline).
    COLOCATED = "colocated"
    # Stop after sampling the first token and keep the prompt's KV for a transfer.
    PREFILL_ONLY = "prefill_only"
    # Admit sequences whose KV was imported into the pool; a prompt is prefilled locally
    # only when the caller says so (`add_request(..., local_prefill=True)`: conditional
    # disaggregation, or recovery from a failed pull), so a stray prompt is refused.
    DECODE_ONLY = "decode_only"


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts read from a Hugging Face `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Qwen2 always has q/k/v biases; Llama has them when `attention_bias` is set.
    qkv_bias: bool
    # `rope_theta` plus the scaling entries (`rope_type`, `factor`, ...).
    rope_parameters: dict[str, Any]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Mistral-style sliding window; None when attention is global.
    sliding_window: int | None
    torch_dtype: str

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        raw = json.loads(config_file.read_text())
        return cls.from_dict(raw, generation=_read_generation_config(path))

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}"
            )
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = raw.get("head_dim") or hidden // num_heads
        rope: dict[str, Any] = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope.setdefault("rope_theta", float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))))
        rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
        eos = _token_ids((generation or {}).get("eos_token_id", raw.get("eos_token_id")))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", not is_qwen2) else None
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or bool(raw.get("attention_bias", False)),
            rope_parameters=rope,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos,
            sliding_window=int(sliding) if sliding else None,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers, for fp32 (scale by dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _read_generation_config(path: Path) -> dict[str, Any]:
    gen_file = path / "generation_config.json"
    return json.loads(gen_file.read_text()) if gen_file.is_file() else {}


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


# init=False: the constructor takes None for the sizes it derives (max_model_len,
# max_num_batched_tokens, num_blocks), while the attributes are always filled-in ints,
# so readers need no None checks. Each other default is the class attribute above it
# (one definition; `__init__` names it).
@dataclass(init=False)
class EngineConfig:
    """Everything one engine needs; validated on construction."""

    model: str
    # The derived sizes (no class default: `__init__` takes None for "derive it").
    # KV blocks in the pool; given None, derived from `kv_cache_memory_bytes`.
    num_blocks: int
    # Token budget of one engine step (decode tokens + prefill chunk tokens); given None:
    # DEFAULT_MAX_NUM_BATCHED_TOKENS, or max_model_len with chunked prefill off (a whole
    # prompt must fit one step, as in vLLM).
    max_num_batched_tokens: int
    # Longest prompt + output; given None: the model's `max_position_embeddings`.
    max_model_len: int
    # Tokens per KV block.
    block_size: int = DEFAULT_BLOCK_SIZE
    # Bytes of KV cache (all layers, K and V) when num_blocks is not given.
    kv_cache_memory_bytes: int = 1 << 30
    # Most sequences in one batch.
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    # When off, a prompt is prefilled in one step (the budget must cover max_model_len).
    enable_chunked_prefill: bool = True
    mode: EngineMode = EngineMode.COLOCATED
    # float32 | bfloat16 | float16 | "auto" (`auto_dtype`: the checkpoint's dtype on CUDA,
    # bf16 on CPUs with bf16 GEMM instructions, else float32). The library default is exact
    # float32 (the equality contract's dtype); the CLIs default to "auto".
    dtype: str = "float32"
    # "cpu", "cuda" or "cuda:N" (a `DeviceKind`, optionally with a GPU index).
    device: str = DeviceKind.CPU
    # torch intra-op threads; None leaves torch's default.
    num_threads: int | None = None
    # How long a prefill-only engine keeps unpulled KV before freeing it.
    kv_lease_s: float = 30.0
    # "auto" (triton on CUDA, torch on CPU), "torch" or "triton"; see engine/attention.
    attention_backend: str = "auto"
    # "auto" (decode CUDA graphs on CUDA with the triton backend), "on" or "off"; see
    # engine/cuda_graphs.py.
    cuda_graphs: str = "auto"
    model_config: ModelConfig = field(init=False, repr=False)

    def __init__(
        self,
        model: str,
        block_size: int = block_size,
        num_blocks: int | None = None,
        kv_cache_memory_bytes: int = kv_cache_memory_bytes,
        max_num_seqs: int = max_num_seqs,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = enable_prefix_caching,
        enable_chunked_prefill: bool = enable_chunked_prefill,
        mode: EngineMode = mode,
        dtype: str = dtype,
        device: str = device,
        num_threads: int | None = num_threads,
        kv_lease_s: float = kv_lease_s,
        attention_backend: str = attention_backend,
        cuda_graphs: str = cuda_graphs,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.max_num_seqs = max_num_seqs
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_chunked_prefill = enable_chunked_prefill
        self.mode = parse_enum(EngineMode, mode, "mode")
        self.dtype = dtype
        self.device = device
        self.num_threads = num_threads
        self.kv_lease_s = kv_lease_s
        self.attention_backend = attention_backend
        self.cuda_graphs = cuda_graphs
        self.model_config = ModelConfig.from_model_dir(model)
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        self.max_model_len = self._resolve_max_model_len(max_model_len)
        self.max_num_batched_tokens = self._resolve_max_num_batched_tokens(max_num_batched_tokens)
        self._check_placement()
        self.num_blocks = self._resolve_num_blocks(num_blocks)

    def _resolve_max_model_len(self, requested: int | None) -> int:
        limit = self.model_config.max_position_embeddings
        max_model_len = limit if requested is None else requested
        if not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [1, {limit}], got {max_model_len}")
        window = self.model_config.sliding_window
        if window is not None and window < max_model_len:
            # Attention is global inside the window, so capping the length keeps it exact.
            logger.warning("sliding window %d < max_model_len; capping max_model_len", window)
            max_model_len = window
        return max_model_len

    def _resolve_max_num_batched_tokens(self, requested: int | None) -> int:
        if requested is not None:
            budget = requested
        elif self.enable_chunked_prefill:
            budget = DEFAULT_MAX_NUM_BATCHED_TOKENS
        else:
            budget = self.max_model_len
        if budget < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {budget}")
        if not self.enable_chunked_prefill and budget < self.max_model_len:
            raise ValueError(
                "with chunked prefill off, max_num_batched_tokens "
                f"({budget}) must be >= max_model_len ({self.max_model_len})"
            )
        return budget

    def _check_placement(self) -> None:
        """dtype, device, threads and the KV lease."""
        if self.dtype not in _DTYPES and self.dtype != "auto":
            raise ValueError(
                f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {self.dtype!r}"
            )
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device != DeviceKind.CPU and not torch.cuda.is_available():
            raise ValueError(f"device {self.device}: this machine has no CUDA device")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.kv_lease_s <= 0:
            raise ValueError(f"kv_lease_s must be > 0, got {self.kv_lease_s}")
        # Raises when the backend cannot run here (checked again where the engine starts).
        backend = resolve_attention_backend(self.attention_backend, self.device)
        if backend == "triton" and self.device == "cpu" and self.resolved_dtype == "bfloat16":
            raise ValueError(
                "attention_backend triton on cpu (Triton's interpreter) computes bfloat16 "
                "dot products wrongly; use dtype float32 or float16"
            )
        resolve_cuda_graphs(self.cuda_graphs, self.device, backend.value)

    @property
    def use_cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (`cuda_graphs` resolved here)."""
        return resolve_cuda_graphs(self.cuda_graphs, self.device, self.resolved_attention_backend)

    @property
    def resolved_attention_backend(self) -> str:
        """The backend `attention_backend` stands for on this device ('torch' or 'triton')."""
        return resolve_attention_backend(self.attention_backend, self.device).value

    def _resolve_num_blocks(self, requested: int | None) -> int:
        if requested is None:
            per_block = self.model_config.kv_bytes_per_token * self.block_size
            per_block *= torch.empty((), dtype=self.torch_dtype).element_size()
            num_blocks = self.kv_cache_memory_bytes // per_block
            # As vLLM: a cache too small for one longest sequence is a start-up error, not
            # requests refused later.
            if num_blocks < self.blocks_for(self.max_model_len):
                raise ValueError(
                    f"a KV cache of {self.kv_cache_memory_bytes} bytes holds "
                    f"{num_blocks * self.block_size} tokens ({per_block} bytes per "
                    f"{self.block_size}-token block), fewer than max_model_len "
                    f"{self.max_model_len}: give it more memory or lower max_model_len"
                )
            return num_blocks
        if requested < 1:
            raise ValueError(f"num_blocks must be >= 1, got {requested}")
        return requested

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.resolved_dtype]

    @property
    def resolved_dtype(self) -> str:
        """The dtype the engine runs ("auto" resolved), e.g. "bfloat16"."""
        if self.dtype != "auto":
            return str(_DTYPES[self.dtype]).removeprefix("torch.")
        return auto_dtype(self.device, self.model_config.torch_dtype)

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks needed to hold `num_tokens` tokens."""
        return math.ceil(num_tokens / self.block_size)
