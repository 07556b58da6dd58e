"""A CPU step's decoder stack in one C++ call (engine/cpu_ops/decoder_stack.cpp).

The op runs what `LlamaForCausalLM.forward` runs with the `cpu` attention backend and the
cpu kernels (cpu_kernels.py), in the same order (so the same numbers), without Python
between the ops: at decode batch 1 their Python dispatch cost a third as much as the
matmuls, and a short prefill's more than half. It covers a step's decodes and its prefill
chunks when the backend attends every chunk in place (`paged_prefill`); steps with other
chunks, other backends and dtypes other than float32 and bfloat16 run the Python model.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.engine.attention.cpu_paged_backend import (
    CpuPagedAttentionBackend,
    CpuPagedAttentionMetadata,
)
from tandem.engine.attention.metadata import AttentionMetadata
from tandem.engine.model.linear import Linear


class CpuDecoderStack:
    """The model's layers and final norm in one op call (weights shared, not copied)."""

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
        backend: CpuPagedAttentionBackend = model.attention_backend
        self.scale = backend.scale
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        # Whether the backend attends this model's prefill chunks in place.
        self.attends_prefills = backend.attends_in_place(norm.weight.dtype, cfg.head_dim)

    def covers(self, meta: AttentionMetadata) -> bool:
        """Whether the step is laid out for the `cpu` backend, with no prefill chunk the op
        cannot attend."""
        return isinstance(meta, CpuPagedAttentionMetadata) and (
            self.attends_prefills or not meta.prefills
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
        spans = meta.prefills
        return torch.ops.tandem_cpu.decoder_stack(
            embeddings, self.weights, self.qkv_biases, self.final_norm,
            self.norm_eps, cos, sin, kv_caches, meta.slot_mapping,
            meta.decode_block_tables, meta.decode_seq_lens,
            [span.block_table for span in spans], [span.query_start for span in spans],
            [span.query_len for span in spans], [span.context_len for span in spans],
            self.scale, self.num_heads, self.num_kv_heads,
        )  # fmt: skip


def _weight(linear: Linear) -> torch.Tensor:
    """The weight the op multiplies by: packed where the loader packed it, which
    the op tells from its rank."""
    return linear.packed_weight if linear.packed_weight is not None else linear.weight
