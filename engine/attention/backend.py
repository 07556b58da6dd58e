"""Attention backend interface and the torch reference backend (CPU and CUDA).

A backend writes the step's new K/V into the paged cache and computes attention of
the step's queries against each sequence's whole context.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from tandem.engine.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D], kv_cache [2, blocks, block_size, Hkv, D].

        Returns the attention output [T, Hq * D].
        """
        ...


class TorchAttentionBackend:
    """Gathers each sequence's blocks and calls `scaled_dot_product_attention`."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        # Reused K and V gather buffers of the decode path (one step at a time).
        self._buffers: list[torch.Tensor | None] = [None, None]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = key.shape[1]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value)
        out = torch.empty_like(query)
        num_decodes = meta.num_decodes
        if num_decodes:
            out[:num_decodes] = self._decode(query[:num_decodes], k_cache, v_cache, meta)
        for span in meta.prefills:
            end = span.query_start + span.query_len
            q = query[span.query_start : end].transpose(0, 1).unsqueeze(0)
            if span.mask is None:
                k = key[span.query_start : end]
                v = value[span.query_start : end]
            else:
                k = _gather(k_cache, span.block_table, span.seq_len)
                v = _gather(v_cache, span.block_table, span.seq_len)
            o = F.scaled_dot_product_attention(
                q,
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                attn_mask=span.mask,
                is_causal=span.mask is None,
                scale=self.scale,
                enable_gqa=True,
            )
            out[span.query_start : end] = o[0].transpose(0, 1)
        return out.view(num_tokens, num_heads * head_dim)

    def _decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """All one-token queries in one SDPA call over their padded, gathered contexts."""
        num_decodes = query.shape[0]
        length = meta.max_decode_len
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        num_blocks = -(-length // block_size)
        index = meta.block_tables[:num_decodes, :num_blocks].reshape(-1)
        # Gathered into reused buffers: fresh multi-MB allocations cost page faults per layer.
        k = torch.index_select(k_cache, 0, index, out=self._scratch(0, k_cache, index.numel()))
        v = torch.index_select(v_cache, 0, index, out=self._scratch(1, v_cache, index.numel()))
        k = k.view(num_decodes, -1, num_kv_heads, head_dim)[:, :length]
        v = v.view(num_decodes, -1, num_kv_heads, head_dim)[:, :length]
        o = F.scaled_dot_product_attention(
            query.unsqueeze(2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=meta.decode_mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(2)

    def _scratch(self, slot: int, cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """A [num_blocks, *block shape] buffer for gathered blocks, grown on demand."""
        shape = (num_blocks, *cache.shape[1:])
        buf = self._buffers[slot]
        if buf is None or buf.shape[0] < num_blocks or buf.dtype != cache.dtype:
            buf = torch.empty(shape, dtype=cache.dtype, device=cache.device)
            self._buffers[slot] = buf
        return buf[:num_blocks]


def _gather(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, Hkv, D] keys or values of one sequence, in position order."""
    return cache[block_table].flatten(0, 1)[:seq_len]


def get_attention_backend(name: str, scale: float) -> AttentionBackend:
    if name == "torch":
        return TorchAttentionBackend(scale)
    raise ValueError(f"unknown attention backend {name!r}; available: 'torch'")
