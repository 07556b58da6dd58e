"""A CPU step's decoder stack in one C++ call (engine/cpu_ops/decoder_stack.cpp).

The op runs what `LlamaForCausalLM.forward` runs with the `cpu` attention backend and the
cpu kernels (cpu_kernels.py), in the same order (so the same numbers), without Python
between the ops: at decode batch 1 their Python dispatch cost a third as much as the
matmuls, and a short prefill's more than half. It covers a step's decodes and its prefill
chunks when the backend attends every chunk in place (`paged_prefill`); steps with other
chunks, other backends and dtypes other than float32 and bfloat16 run the Python model.
The step's lists (token ids, positions, cache slots, the decodes' block tables and lengths)
go to the op as they are, and it looks up the embeddings and RoPE rows itself: no tensors
built per step. After the forward has streamed the weights through the caches, each torch
call the step made for them cost ~17-90 us.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.engine.attention.cpu_paged_backend import CpuPagedAttentionBackend
from tandem.engine.attention.metadata import BatchLayout
from tandem.engine.attention.torch_backend import prefill_spans
from tandem.engine.model.linear import Linear


class CpuDecoderStack:
    """The model's embedding lookup, layers and final norm in one op call (weights shared,
    not copied)."""

    def __init__(self, model: Any) -> None:
        cfg = model.config
        # The table, or the tied head's packed panels once the model packed it (the op
        # reads a row from either).
        embed = model.embed_tokens
        self.embedding_table = (
            embed.weight.detach() if embed is not None else model.lm_head.packed_weight
        )
        self.vocab_size = cfg.vocab_size
        self.rope_table = model.rotary.cos_sin
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

    def covers(self, batch: BatchLayout) -> bool:
        """Whether the op attends every chunk of the step (its decodes always)."""
        return self.attends_prefills or batch.num_decodes == batch.num_seqs

    def __call__(
        self,
        token_ids: list[int],
        positions: list[int],
        kv_caches: torch.Tensor,
        batch: BatchLayout,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden]; writes the step's K/V into `kv_caches`."""
        num_decodes = batch.num_decodes
        decode_tables, width = batch.flat_block_tables(num_decodes)
        spans = prefill_spans(batch)
        return torch.ops.tandem_cpu.decoder_stack(
            self.embedding_table, self.vocab_size, token_ids, self.rope_table, positions,
            self.weights, self.qkv_biases, self.final_norm, self.norm_eps, kv_caches, batch.slots,
            decode_tables, width, batch.seq_lens[:num_decodes],
            [span.block_table for span in spans], [span.query_start for span in spans],
            [span.query_len for span in spans], [span.context_len for span in spans],
            self.scale, self.num_heads, self.num_kv_heads,
        )  # fmt: skip


def _weight(linear: Linear) -> torch.Tensor:
    """The weight the op multiplies by: packed where the loader packed it, which
    the op tells from its rank."""
    return linear.packed_weight if linear.packed_weight is not None else linear.weight
