"""A decode-only CPU step's decoder stack in one C++ call (engine/cpu_ops/decode_forward.cpp).

The op runs what `LlamaForCausalLM.forward` runs with the `cpu` attention backend and the
cpu kernels (cpu_kernels.py), in the same order (so the same numbers), without Python
between the ops: at batch 1 their Python dispatch cost a third as much as the matmuls.
Steps with prefill chunks, other backends and dtypes other than float32 and bfloat16 run the
Python model.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.engine.attention.cpu_paged_backend import CpuPagedAttentionMetadata
from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.model.linear import Linear


class CpuDecodeStack:
    """The model's layers and final norm for decode-only steps (weights shared, not copied)."""

    def __init__(self, model: Any) -> None:
        cfg = model.config
        layers = list(model.layers)
        self.weights = [
            weight.detach()
            for layer in layers
            for weight in (layer.input_layernorm.weight, _weight(layer.self_attn.qkv_proj),
                           _weight(layer.self_attn.o_proj), layer.post_attention_layernorm.weight,
                           _weight(layer.mlp.gate_up_proj), _weight(layer.mlp.down_proj))
        ]  # fmt: skip
        self.qkv_biases = (
            [layer.self_attn.qkv_proj.bias.detach() for layer in layers] if cfg.qkv_bias else []
        )
        norm = model.norm
        self.final_norm = norm.weight.detach()
        self.norm_eps = norm.eps
        self.scale = model.attention_backend.scale
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads

    @staticmethod
    def covers(meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether the step is decodes only, laid out for the `cpu` backend."""
        return (
            isinstance(meta, CpuPagedAttentionMetadata)
            and meta.num_decodes == num_tokens
            and not meta.prefills
        )

    def __call__(
        self,
        embeddings: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: torch.Tensor,
        meta: CpuPagedAttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden]; writes the step's K/V into `kv_caches`."""
        cos, sin = rope
        return torch.ops.tandem_cpu.decode_forward(
            embeddings, self.weights, self.qkv_biases, self.final_norm,
            self.norm_eps, cos, sin, kv_caches, meta.slot_mapping,
            meta.decode_block_tables, meta.decode_seq_lens, self.scale,
            self.num_heads, self.num_kv_heads,
        )  # fmt: skip


def _weight(linear: Linear) -> torch.Tensor:
    """The weight the op multiplies by: packed where the loader packed it, which
    the op tells from its rank."""
    return linear.packed_weight if linear.packed_weight is not None else linear.weight
