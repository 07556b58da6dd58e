"""Builds a model from a Hugging Face model directory (config + safetensors shards).

Checkpoint names are mapped onto the fused layout of `engine.model.llama`: separate
q/k/v and gate/up weights are concatenated as they stream in, one tensor at a time,
so peak memory stays near one copy of the model.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tandem.engine.attention import get_attention_backend
from tandem.engine.config import ModelConfig
from tandem.engine.model.cpu_kernels import KERNEL_DTYPES, use_cpu_kernels
from tandem.engine.model.cpu_stack import CpuDecoderStack
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.model.rotary import RotaryEmbedding, inverse_frequencies

logger = logging.getLogger(__name__)

# checkpoint sub-name -> (our parameter sub-name, index of the shard in the fused tensor)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    attention_backend: str = "torch",
) -> LlamaForCausalLM:
    """The model in eval mode on `device`, weights in `dtype`."""
    hf_config = None
    if cfg.rope_parameters.get("rope_type", "default") != "default":
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(str(model_dir))
    inv_freq, scaling = inverse_frequencies(cfg.head_dim, cfg.rope_parameters, hf_config)
    # A one-position table on the CPU (the real one is built below): its arange on the
    # meta device would import torch's Python decompositions (~2 s of a worker's start).
    placeholder = RotaryEmbedding(inv_freq, scaling, 1, dtype)
    with torch.device("meta"):
        backend = get_attention_backend(
            attention_backend, scale=cfg.head_dim**-0.5, device=device.type
        )
        model = LlamaForCausalLM(cfg, placeholder, backend)
    _materialize(model, device, dtype)
    if cfg.tie_word_embeddings and model.embed_tokens is not None:
        # _materialize gives each occurrence of a shared parameter its own storage.
        model.lm_head.weight = model.embed_tokens.weight
    # The RoPE tables, computed in float32 (as in transformers), are built for real here.
    rotary = RotaryEmbedding(inv_freq, scaling, max_model_len, dtype).to(device)
    model.rotary = rotary
    _load_weights(model, Path(model_dir), cfg)
    if backend.loads_cpu_ops and dtype in KERNEL_DTYPES:
        # The C++ CPU path: the ops' build also holds the fused kernels and the
        # one-call decoder stack (the torch backend stays the pure-torch reference).
        use_cpu_kernels(model)
        model.cpu_stack = CpuDecoderStack(model)
    return model.eval()


def _checkpoint_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def _materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Uninitialized storage on `device` for every parameter and buffer of a model built
    on the meta device, floating ones in `dtype`: what `to_empty(device=device).to(dtype)`
    gives, without a float32 copy of a 16-bit model, and without `empty_like` on meta
    tensors (its first call imports torch's Python decompositions: ~1 s of a worker's
    start)."""

    def empty(tensor: torch.Tensor) -> torch.Tensor:
        kind = dtype if tensor.is_floating_point() else tensor.dtype
        return torch.empty(tensor.shape, dtype=kind, device=device)

    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(empty(param), requires_grad=param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, empty(buffer))


def _load_weights(model: LlamaForCausalLM, model_dir: Path, cfg: ModelConfig) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in _checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if name.endswith(_SKIPPED_SUFFIXES):
                    continue
                target, shard = _target(name)
                if target not in params:
                    if target == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue
                    raise ValueError(f"unexpected weight {name!r} in {file.name}")
                _copy_into(params[target], target, shard, f.get_tensor(name), cfg)
                loaded.add(f"{target}#{shard}")
    expected = _expected_keys(model, cfg)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"weights missing from checkpoint: {missing[:8]}")


def _target(name: str) -> tuple[str, int | None]:
    """Our parameter name for a checkpoint tensor, and its shard index when fused."""
    match = _LAYER_RE.match(name)
    if match is None:
        return name.removeprefix("model."), None
    layer, module, kind = match.groups()
    if module in _FUSED:
        fused, shard = _FUSED[module]
        return f"layers.{layer}.{fused}.{kind}", shard
    return f"layers.{layer}.{module}.{kind}", None


def _shard_rows(cfg: ModelConfig, fused_name: str, shard: int) -> tuple[int, int]:
    if "qkv_proj" in fused_name:
        q = cfg.num_heads * cfg.head_dim
        kv = cfg.num_kv_heads * cfg.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][shard]
    inter = cfg.intermediate_size
    return [(0, inter), (inter, 2 * inter)][shard]


@torch.no_grad()
def _copy_into(
    param: torch.Tensor, name: str, shard: int | None, tensor: torch.Tensor, cfg: ModelConfig
) -> None:
    if shard is None:
        dest = param
    else:
        start, end = _shard_rows(cfg, name, shard)
        dest = param[start:end]
    if dest.shape != tensor.shape:
        raise ValueError(
            f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)} vs {tuple(dest.shape)}"
        )
    dest.copy_(tensor)


def _expected_keys(model: LlamaForCausalLM, cfg: ModelConfig) -> set[str]:
    keys: set[str] = set()
    for name, _ in model.named_parameters(remove_duplicate=True):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ".qkv_proj." in name:
            keys.update(f"{name}#{i}" for i in range(3))
        elif ".gate_up_proj." in name:
            keys.update(f"{name}#{i}" for i in range(2))
        else:
            keys.add(f"{name}#None")
    return keys
